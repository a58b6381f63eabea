"""Standalone runs that check a machine: two-process loopback handoffs and soaks."""
