"""Groups across hosts: shared memory inside each host, gloo between hosts."""
