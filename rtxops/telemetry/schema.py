"""Names shared by everything that writes or reads rtxops telemetry.

No OpenTelemetry semantic convention covers kernels, so span names and kernel attributes are ours
under ``rtx.``; resource attributes follow OTel (``service.name``, ``host.name``, ``process.pid``,
``hw.*``) plus ``rtx.job.id`` and ``rtx.rank``.
"""
from __future__ import annotations

# ---- span names --------------------------------------------------------------------------------
STEP = "rtx.step"          # one per optimizer step
KERNEL = "rtx.kernel"      # child of rtx.step: one per (op, variant, config, bucket, site, phase) in the step
CALL = "rtx.call"          # one sampled individual call
COMPILE = "rtx.compile"    # building a variant (torch.compile or other) for a bucket
SWAP = "rtx.swap"          # a plan swap at a step boundary
TRIAL = "rtx.trial"        # an evolve trial (offline or online)
SPAN_NAMES = (STEP, KERNEL, CALL, COMPILE, SWAP, TRIAL)

# ---- resource attributes -----------------------------------------------------------------------
SERVICE_NAME = "service.name"
HOST_NAME = "host.name"
PROCESS_PID = "process.pid"
JOB_ID = "rtx.job.id"
RANK = "rtx.rank"
HW_CPU_MODEL = "hw.cpu.model"
HW_GPU_MODEL = "hw.gpu.model"
HW_GPU_COUNT = "hw.gpu.count"
TORCH_VERSION = "rtx.torch.version"
TRITON_VERSION = "rtx.triton.version"
CUDA_VERSION = "rtx.cuda.version"

# ---- span attributes (typed columns in the store) ----------------------------------------------
STEP_NUMBER = "rtx.step"
PLAN_VERSION = "rtx.plan.version"
OP = "rtx.op"
VARIANT = "rtx.variant"
FAMILY = "rtx.family"
CONFIG = "rtx.config"          # canonical JSON of the variant's config
BUCKET = "rtx.bucket"          # Bucket.id, e.g. "float32/cpu/hidden=64,rows=512"
SITE = "rtx.site"              # "F.linear", "module:pkg.LlamaRMSNorm", "fn:pkg.apply_rotary_pos_emb"
PHASE = "rtx.phase"            # "fwd" | "bwd"
COUNT = "rtx.count"            # calls aggregated in a kernel span
TOTAL_NS = "rtx.total_ns"
MIN_NS = "rtx.min_ns"
MAX_NS = "rtx.max_ns"
HIST = "rtx.hist_log2_ns"      # int array: calls whose duration has bit_length i
CACHE_HITS = "rtx.cache.hits"  # the runtime's variant build cache
CACHE_MISSES = "rtx.cache.misses"
MEM_DELTA = "rtx.mem.delta_bytes"
MEM_PEAK = "rtx.mem.peak_bytes"
SAMPLED = "rtx.sampled"        # bool: the figures come from a sample, not every call

# ---- step attributes (JSON column) -------------------------------------------------------------
RSS = "rtx.mem.rss_bytes"
CUDA_ALLOCATED = "rtx.cuda.allocated_bytes"
CUDA_RESERVED = "rtx.cuda.reserved_bytes"
CUDA_FRAGMENTATION = "rtx.cuda.fragmentation"
CUDA_PEAK = "rtx.cuda.peak_bytes"
CUDA_ALLOC_RETRIES = "rtx.cuda.alloc_retries"
CUDA_OOMS = "rtx.cuda.ooms"
DROPPED_RECORDS = "rtx.dropped.records"   # call records the recorder could not keep (buffer full)
DROPPED_STEPS = "rtx.dropped.steps"       # steps the exporter queue could not take or build
INDUCTOR_FXGRAPH_HITS = "rtx.cache.inductor.fxgraph_hits"
INDUCTOR_FXGRAPH_MISSES = "rtx.cache.inductor.fxgraph_misses"
TRITON_AUTOTUNE_HITS = "rtx.cache.triton.autotune_hits"
TRITON_AUTOTUNE_MISSES = "rtx.cache.triton.autotune_misses"

# ---- swap / error attributes --------------------------------------------------------------------
PLAN_FROM = "rtx.plan.from"
PLAN_TO = "rtx.plan.to"
PLAN_DIGEST = "rtx.plan.digest"
ERROR_EVENT = "rtx.variant.disabled"   # span event on rtx.step
REASON = "rtx.reason"

# Attributes the store keeps in typed columns; every other attribute goes to the JSON column.
TYPED_SPAN_ATTRIBUTES = {
    STEP_NUMBER: "BIGINT",
    PLAN_VERSION: "BIGINT",
    OP: "VARCHAR",
    VARIANT: "VARCHAR",
    CONFIG: "VARCHAR",
    BUCKET: "VARCHAR",
    SITE: "VARCHAR",
    PHASE: "VARCHAR",
    COUNT: "BIGINT",
    TOTAL_NS: "BIGINT",
    MIN_NS: "BIGINT",
    MAX_NS: "BIGINT",
}
TYPED_RESOURCE_ATTRIBUTES = {SERVICE_NAME: "VARCHAR", HOST_NAME: "VARCHAR", JOB_ID: "VARCHAR",
                             RANK: "INTEGER", PROCESS_PID: "BIGINT"}
