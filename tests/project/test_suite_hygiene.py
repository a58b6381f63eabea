"""Rules the suite keeps so that tests running side by side cannot break each other.

**No test gives an interface of the root network namespace an IPv4 address.** Every UCX
worker publishes an address for each TCP interface with one when it starts; the suite runs
in parallel, so a rank started while such an interface existed publishes it, and a peer
made after the test removed it can pick that address and be refused "Destination is
unreachable" on every try (docs/nixl.md: seen twice in suite runs, then reproduced). The
two-host tests give addresses inside their own namespaces only (``ip -n NS addr add``).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _strings(nodes: list[ast.expr]) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _ip_command(call: ast.Call) -> list[str]:
    """The literal words of an ``ip(...)`` call, or of an ``["ip", ...]`` argv passed to one; [] otherwise."""
    if isinstance(call.func, ast.Name) and call.func.id == "ip":
        return ["ip", *_strings(call.args)]
    for arg in call.args:
        if isinstance(arg, (ast.List, ast.Tuple)) and _strings(arg.elts)[:1] == ["ip"]:
            return _strings(arg.elts)
    return []


def root_namespace_addresses(source: str) -> list[int]:
    """Lines of ``source`` that run ``ip addr add`` outside a namespace (no ``-n NS``, no ``netns exec``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        words = _ip_command(node) if isinstance(node, ast.Call) else []
        adds = any(a in ("a", "addr", "address") and b == "add" for a, b in zip(words, words[1:]))
        if adds and not {"-n", "-netns", "exec"} & set(words):
            lines.append(node.lineno)
    return lines


def test_no_test_gives_the_root_namespace_an_address():
    found = {str(path.relative_to(TESTS)): lines for path in sorted(TESTS.rglob("*.py"))
             if (lines := root_namespace_addresses(path.read_text()))}
    assert not found, f"an IPv4 address on an interface of the root namespace (use `ip -n NS`): {found}"


def test_the_address_rule_can_fail():
    assert root_namespace_addresses('ip("addr", "add", "10.0.0.1/24", "dev", "v0")') == [1]
    assert root_namespace_addresses('subprocess.run(["ip", "address", "add", "10.0.0.1/24", "dev", "v0"])') == [1]
    assert root_namespace_addresses('ip("-n", ns, "addr", "add", "10.0.0.1/24", "dev", "v0")') == []
    assert root_namespace_addresses('ip("route", "add", "10.0.0.1/32", "dev", "v0")') == []
