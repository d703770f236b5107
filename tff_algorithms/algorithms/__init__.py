"""The training algorithms, each declared once in the registry (`registry`).

One registration module per family: `dp_fedemb` (dp-fedemb, dp-fedavg,
dp-ftrl-fedemb), `centralized`, `logit_dp`, `user_dp_sgd` (dp-sgd-centralized,
dp-last-layer) and `fdml`. Importing this package registers them all, in the order
`names()` lists them. Everything here is TensorFlow-free and may import only
TensorFlow-free modules (`accounting`, `recipes`, `beam_jobs.schedule`, the algorithms'
`*_config` / `*_fields` modules); trainers are imported when a job trains
(`Algorithm.load_trainer`). How an algorithm plugs in: docs/design.md.
"""

# isort: off
# Registration order is the order `names()` (and so --help and error lines) lists.
from tff_algorithms.algorithms import dp_fedemb
from tff_algorithms.algorithms import centralized
from tff_algorithms.algorithms import logit_dp
from tff_algorithms.algorithms import fdml
from tff_algorithms.algorithms import user_dp_sgd

# isort: on
from tff_algorithms.algorithms.registry import (
    Algorithm,
    find,
    get,
    names,
    register,
    unregister,
)

__all__ = [
    "Algorithm",
    "centralized",
    "dp_fedemb",
    "fdml",
    "find",
    "get",
    "logit_dp",
    "names",
    "register",
    "unregister",
    "user_dp_sgd",
]
