"""Trust between processes: authenticated control frames and sealed transfer metas."""
