"""FX graph passes over collectives: lowering, bucketing, overlap scheduling, rank checks.

Each pass is a ``torch.fx.passes.infra.pass_base.PassBase`` registered by name; run one with
``get_pass(name, config)(gm)`` or several with ``run_pipeline(gm, config, names)``.

Layout: :mod:`~fcoll.passes.config` (``FcollConfig``, the pass order),
:mod:`~fcoll.passes.graph` (every graph query) and :mod:`~fcoll.passes.registry` (registry,
pipeline) at the top; :mod:`fcoll.passes.analysis`, what the passes read and never rewrite (cost
model, storage model, lane simulator, calibration, collective-sequence fingerprints);
:mod:`fcoll.passes.rewrites`, the passes below. ``analysis`` imports nothing from ``rewrites``.

=========================  ===================================================================
pass                       what it does
=========================  ===================================================================
lower_c10d_functional      ``torch.ops._c10d_functional.*`` -> ``torch.ops.fcoll.*``
fold_all_reduce_sums       ``ar(a) + ar(b)`` -> ``ar(a + b)`` (sum / avg; tensor parallel's backward)
bucket_collectives         merge same-key collectives into buckets of <= ``bucket_cap_mb``
sink_output_waits          waits that only feed the output, with their chains, to the end
sink_waits                 each wait just before the first use of its result
raise_collectives          each collective just after its last input is ready
reorder_for_overlap        cost-model list scheduling under memory / in-flight budgets
check_rank_consistency     compare collective fingerprints across ranks (raises, never hangs)
=========================  ===================================================================
"""

from fcoll.passes.rewrites.bucket_plan import Bucket, plan_buckets
from fcoll.passes.rewrites.bucketing import BucketCollectives, apply_buckets
from fcoll.passes.rewrites.group_plan import BucketPlanError
from fcoll.passes.rewrites.shared_plan import BucketPlanTimeoutError
from fcoll.passes.analysis.fingerprints import fingerprint
from fcoll.passes.rewrites.consistency import (
    CheckRankConsistency, RankMismatchError, RankTimeoutError,
)
from fcoll.passes.rewrites.lower import LowerC10dFunctional
from fcoll.passes.rewrites.output_chains import SinkOutputWaits
from fcoll.passes.rewrites.reduce_sums import FoldAllReduceSums
from fcoll.passes.rewrites.overlap import (
    PredictedEvent, RaiseCollectives, ReorderForOverlap, SinkWaits, predict,
)
from fcoll.passes.registry import (
    FcollPass, PassFailed, get_pass, register_pass, registered_passes, run_pipeline,
)

__all__ = [
    "Bucket", "plan_buckets", "apply_buckets", "BucketCollectives", "BucketPlanError",
    "BucketPlanTimeoutError", "CheckRankConsistency",
    "RankMismatchError", "RankTimeoutError", "fingerprint", "LowerC10dFunctional",
    "FoldAllReduceSums", "PredictedEvent", "RaiseCollectives", "ReorderForOverlap", "SinkWaits", "SinkOutputWaits",
    "predict", "FcollPass", "PassFailed", "get_pass", "register_pass", "registered_passes", "run_pipeline",
]
