"""The validity dates of our own TLS client certificate, checked before we connect to etcd.

etcd refuses an expired (or not yet valid) client certificate with a bare TLS alert, "bad
certificate", that names neither the certificate nor the reason. We hold the file, so we
read its dates first and say which certificate is out of date and since when. Only the
stdlib: a certificate's ``validity`` sits at a fixed place in its DER encoding
(``Certificate > tbsCertificate > [version], serial, signature, issuer, validity``), which a
few lines of DER walking reach without a cryptography package.
"""

from __future__ import annotations

import base64
import datetime
import re
from typing import Optional

from kvxfer.errors import KVXferError

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.S)


class CertificateDateError(KVXferError):
    """Our client certificate is expired or not yet valid: etcd would only say "bad certificate"."""


def _tlv(der: bytes, at: int) -> tuple[int, int, int]:
    """(tag, start of the value, end of the value) of the DER element at ``at``."""
    tag, length = der[at], der[at + 1]
    at += 2
    if length & 0x80:
        n = length & 0x7F
        length, at = int.from_bytes(der[at:at + n], "big"), at + n
    return tag, at, at + length


def _time(der: bytes, at: int) -> datetime.datetime:
    tag, start, end = _tlv(der, at)
    text = der[start:end].decode("ascii")
    if tag == 0x17:  # UTCTime: YYMMDDHHMMSSZ, years 1950-2049
        value = datetime.datetime.strptime(text, "%y%m%d%H%M%SZ")
    elif tag == 0x18:  # GeneralizedTime: YYYYMMDDHHMMSSZ
        value = datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ")
    else:
        raise ValueError(f"unexpected time tag {tag:#x}")
    return value.replace(tzinfo=datetime.timezone.utc)


def validity(der: bytes) -> tuple[datetime.datetime, datetime.datetime]:
    """(notBefore, notAfter) of one DER certificate; ``ValueError`` if it is not one."""
    try:
        _, tbs, _ = _tlv(der, 0)          # Certificate
        _, at, _ = _tlv(der, tbs)         # tbsCertificate
        if der[at] == 0xA0:               # [0] version, when present
            at = _tlv(der, at)[2]
        for _ in range(3):                # serialNumber, signature, issuer
            at = _tlv(der, at)[2]
        _, start, _ = _tlv(der, at)       # validity
        not_before = _time(der, start)
        return not_before, _time(der, _tlv(der, start)[2])
    except (IndexError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a DER certificate ({exc})") from None


def check_certificate_dates(path: str, what: str, now: Optional[datetime.datetime] = None) -> None:
    """Raise ``CertificateDateError`` naming ``path`` if a certificate in it is out of its validity dates.

    A file we cannot read as PEM is left to ``ssl``, whose own error names the problem.
    """
    try:
        with open(path, "rb") as fh:
            blocks = _PEM.findall(fh.read())
    except OSError:
        return
    now = now or datetime.datetime.now(datetime.timezone.utc)
    for n, block in enumerate(blocks):
        try:
            not_before, not_after = validity(base64.b64decode(b"".join(block.split())))
        except ValueError:
            return
        which = f"{what} {path}" + (f" (certificate {n + 1} of its chain)" if n else "")
        if now > not_after:
            raise CertificateDateError(
                f"the {which} expired on {not_after:%Y-%m-%d %H:%M:%S} UTC (valid from {not_before:%Y-%m-%d}): "
                "etcd would refuse it with only 'bad certificate'; renew it")
        if now < not_before:
            raise CertificateDateError(
                f"the {which} is not valid before {not_before:%Y-%m-%d %H:%M:%S} UTC (now "
                f"{now:%Y-%m-%d %H:%M:%S} UTC): etcd would refuse it with only 'bad certificate'; check this "
                "host's clock or the certificate")
