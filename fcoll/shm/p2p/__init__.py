"""Point-to-point: per-rank inboxes and the send/recv protocol."""
