"""The names in a training job's output directory, in a module with no TensorFlow.

`job_outputs` writes them; the pipeline's training and report components (which publish
metrics.json and ledger.json as artifacts under the same names) and the tests read them
without importing TensorFlow Federated.
"""

CHECKPOINT_DIR = "checkpoints"
SAVED_MODEL_DIR = "saved_model"
METRICS_FILE = "metrics.json"
LEDGER_FILE = "ledger.json"
# Beside a model's training ledger in the pipeline: the epsilon of every private run its
# weights come from, composed (tff_algorithms.privacy.composition).
COMPOSITION_FILE = "composition.json"
JOB_FILE = "train_job.json"
FEATURE_CACHE_DIR = "feature_cache"
# What a job (`job_outputs`) and `dp-fedemb train` create in OUTPUT: the entries an output
# directory written before `owned_files` kept its record adopts as the product's.
TRAIN_OUTPUT_NAMES = frozenset(
    {
        JOB_FILE,
        CHECKPOINT_DIR,
        SAVED_MODEL_DIR,
        METRICS_FILE,
        LEDGER_FILE,
        FEATURE_CACHE_DIR,
        "data",
        "logs",
        "tensorboard",
    }
)
