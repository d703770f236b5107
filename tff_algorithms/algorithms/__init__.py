"""The training algorithms: the registry (`registry`, `rules`) and one package per family.

`dp_fedemb/` (dp-fedemb, dp-fedavg, dp-ftrl-fedemb, shared negatives), `centralized/`,
`logit_dp/`, `user_dp_sgd/` (dp-sgd-centralized, dp-last-layer) and `fdml/`. Each
package's `__init__.py` registers its `Algorithm`s; importing this package registers
them all, in the order `names()` lists them. The registry, the specs and the settings
modules they check with are TensorFlow-free and import only `base`, `privacy`, `config`
and `beam_jobs.schedule` (the `config` layer reads them); an algorithm's other modules
may import every package and are imported when a job trains (`Algorithm.load_trainer`).
How an algorithm plugs in: docs/design.md; the layers: docs/layout.md.
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
