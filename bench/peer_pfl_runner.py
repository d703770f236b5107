"""The pfl-research side of the peer benchmark (issue 65, item 5): runs in `.venv-pfl`
(`make peer-env`: pfl 0.6 and PyTorch, outside the product's lock), never in `.venv`.

    .venv-pfl/bin/python bench/peer_pfl_runner.py WORK.npz OUT.json [--threads N]
        [--weights FINAL.npz]

WORK.npz is what `bench/peer_pfl_round.py` exports from a dp-fedavg job: the small
CNN's starting weights in PyTorch's layout (`torch_layout`), every round's virtual
clients' examples (one pfl user each) and the settings. This file builds the same
network in PyTorch and trains it with pfl's `FederatedAveraging` on pfl's simulated
backend: a user sampler that hands out our schedule's virtual clients in order, local
momentum SGD at our client learning rate and batch size, pfl's `GaussianMechanism`
applied centrally (each user's update clipped to our clip norm, noise of std
z x clip on the sum, the sum divided by the cohort) and momentum SGD on the server.
Per round (pfl's `after_central_iteration`): wall seconds and this process's CPU
seconds. Also pfl's own accountants' epsilon for the same z, rounds and sampling rate
(Poisson sampling, add-or-remove-one, sensitivity 1 x clip). `--threads N` sets
PyTorch's intra-op threads (0: PyTorch's default); `--weights FINAL.npz` also writes the
trained parameters.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _network(settings: dict, torch):  # noqa: ANN001, ANN202 - torch is the module
    """The small CNN (`tff_algorithms/modeling/models.py`, `_small_cnn`) with the global
    head (a kernel [embedding, identities], no bias) and softmax cross-entropy."""
    from pfl.metrics import Weighted

    nn = torch.nn

    class SmallCnnWithHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            channels, side = settings["channels"], settings["image_size"] // 4
            self.conv0 = nn.Conv2d(channels, 32, 5, padding=2)
            self.gn0 = nn.GroupNorm(settings["groups"][0], 32, eps=settings["group_norm_epsilon"])
            self.conv1 = nn.Conv2d(32, 64, 5, padding=2)
            self.gn1 = nn.GroupNorm(settings["groups"][1], 64, eps=settings["group_norm_epsilon"])
            self.embedding = nn.Linear(64 * side * side, settings["embedding_size"])
            self.head = nn.Parameter(
                torch.zeros(settings["embedding_size"], settings["num_identities"])
            )

        def forward(self, images):  # noqa: ANN001, ANN202
            x = nn.functional.max_pool2d(torch.relu(self.gn0(self.conv0(images))), 2)
            x = nn.functional.max_pool2d(torch.relu(self.gn1(self.conv1(x))), 2)
            return self.embedding(torch.flatten(x, 1)) @ self.head

        def loss(self, images, labels):  # noqa: ANN001, ANN202
            self.train()
            return nn.functional.cross_entropy(self(images), labels)

        @torch.no_grad()
        def metrics(self, images, labels, eval=False):  # noqa: A002, ANN001, ANN202, ARG002
            self.eval()
            total = nn.functional.cross_entropy(self(images), labels, reduction="sum")
            return {"loss": Weighted(float(total), len(labels))}

    return SmallCnnWithHead()


def pfl_epsilons(settings: dict) -> dict:
    """pfl's accountants' epsilon for the job: Poisson sampling at the per-user rate,
    add-or-remove-one neighbours, noise z relative to sensitivity 1 x clip (none at z = 0,
    where no accountant bounds anything)."""
    if not settings["noise_multiplier"]:
        return {}
    from pfl.privacy import PLDPrivacyAccountant, PRVPrivacyAccountant, RDPPrivacyAccountant

    values = {}
    for name, accountant in (
        ("pld", PLDPrivacyAccountant),
        ("prv", PRVPrivacyAccountant),
        ("rdp", RDPPrivacyAccountant),
    ):
        values[name] = float(
            accountant(
                num_compositions=settings["rounds"],
                sampling_probability=settings["sampling_probability"],
                mechanism="gaussian",
                noise_parameter=settings["noise_multiplier"],
                delta=settings["delta"],
            ).epsilon
        )
    return values


def run(work_npz: str, threads: int, weights_npz: str | None = None) -> dict:
    import functools

    import numpy as np
    import torch

    if threads:
        torch.set_num_threads(threads)
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism

    arrays = np.load(work_npz)
    settings = json.loads(str(arrays["settings"]))
    np.random.seed(settings["seed"])  # pfl draws its per-round seeds from numpy
    torch.manual_seed(settings["seed"])
    network = _network(settings, torch)
    with torch.no_grad():
        for name, parameter in network.named_parameters():
            parameter.copy_(torch.from_numpy(arrays[f"weight/{name}"]))

    # One pfl user per virtual client, in our schedule's order (round by round).
    order = [str(user) for user in settings["schedule"]]
    users = {
        user: Dataset(
            (
                torch.from_numpy(arrays[f"images/{user}"]),
                torch.from_numpy(arrays[f"labels/{user}"]).long(),
            ),
            user_id=user,
        )
        for user in order
    }
    next_user = iter(order)
    training = FederatedDataset(lambda user: users[user], lambda: next(next_user))

    model = PyTorchModel(
        network,
        local_optimizer_create=functools.partial(
            torch.optim.SGD, momentum=settings["client_momentum"]
        ),
        central_optimizer=torch.optim.SGD(
            network.parameters(),
            lr=settings["server_learning_rate"],
            momentum=settings["server_momentum"],
        ),
    )
    mechanism = GaussianMechanism(settings["clip_norm"], settings["noise_multiplier"])
    backend = SimulatedBackend(
        training_data=training,
        val_data=training,
        postprocessors=[CentrallyAppliedPrivacyMechanism(mechanism)],
    )
    marks: list[tuple[float, float]] = []

    class RoundClock(TrainingProcessCallback):
        def on_train_begin(self, *, model):  # noqa: ANN001, ANN202
            marks.append((time.perf_counter(), _cpu_seconds()))
            return super().on_train_begin(model=model)

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):  # noqa: ANN001, ANN202
            marks.append((time.perf_counter(), _cpu_seconds()))
            return False, type(aggregate_metrics)()

    rounds = settings["rounds"]
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            # Iteration 0 always evaluates the cohort before and after training (pfl's
            # rule); it is the warm-up round, left out of the medians.
            evaluation_frequency=rounds + 1,
            train_cohort_size=settings["virtual_clients_per_round"],
            val_cohort_size=0,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=settings["client_learning_rate"],
            local_num_epochs=settings["local_epochs"],
            local_batch_size=settings["batch_size"],
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=settings["batch_size"]),
        callbacks=[RoundClock()],
    )
    final = {name: p.detach().numpy() for name, p in network.named_parameters()}
    if weights_npz is not None:
        np.savez(weights_npz, **final)
    return {
        "threads": torch.get_num_threads(),
        "round_wall_seconds": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
        "round_cpu_seconds": [b[1] - a[1] for a, b in zip(marks, marks[1:])],
        "final_weights_l2": float(np.sqrt(sum(float((w**2).sum()) for w in final.values()))),
        "versions": {"pfl": _version("pfl"), "torch": torch.__version__},
        "pfl_epsilon": pfl_epsilons(settings),
    }


def _version(package: str) -> str:
    from importlib import metadata

    return metadata.version(package)


def main(argv: list[str]) -> int:
    args = list(argv[1:])
    threads, weights = 0, None
    if "--threads" in args:
        at = args.index("--threads")
        try:
            threads = int(args[at + 1])
        except (IndexError, ValueError):
            print("peer_pfl_runner: --threads needs a whole number", file=sys.stderr)
            return 2
        del args[at : at + 2]
    if "--weights" in args:
        at = args.index("--weights")
        if at + 1 == len(args):
            print("peer_pfl_runner: --weights needs a file name", file=sys.stderr)
            return 2
        weights = args[at + 1]
        del args[at : at + 2]
    if len(args) != 2 or not os.path.isfile(args[0]):
        print(
            "usage: peer_pfl_runner.py WORK.npz OUT.json [--threads N] [--weights FINAL.npz] "
            "(WORK.npz from bench/peer_pfl_round.py)",
            file=sys.stderr,
        )
        return 2
    result = run(args[0], threads, weights)
    with open(args[1], "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
