"""fcoll: functional collectives for torch.compile graphs.

``import fcoll as funcol`` is a drop-in for ``torch.distributed._functional_collectives``; importing
fcoll also registers the ``"fcoll"`` shared-memory process-group backend.
"""
