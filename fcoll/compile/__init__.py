"""The ``torch.compile(fn, backend="fcoll")`` backend and what executes its graphs.

Modules: ``backend`` (AOTAutograd, the pass pipeline, compile listeners), ``executor`` (one plan
of typed steps and one loop that runs a lowered graph: collectives start asynchronously, waits
block), ``inductor_compute`` (the same executor with compute segments compiled by Inductor),
``trace`` (Chrome/Perfetto traces of runs).
"""
