"""The ``torch.compile(fn, backend="fcoll")`` backend and what executes its graphs.

Modules: ``backend`` (AOTAutograd, the pass pipeline, compile listeners), ``executor`` (runs a
lowered graph op by op: collectives start asynchronously, waits block), ``inductor_compute``
(compute between collectives compiled by Inductor), ``trace`` (Chrome/Perfetto traces of runs).
"""
