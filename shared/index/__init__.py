"""The Redis block index: its client, server-side scripts, record types and the held-set digest."""
