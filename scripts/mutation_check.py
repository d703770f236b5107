"""Mutation check of the privacy invariants: each fault must make a test fail.

Every privacy claim of the product rests on a few lines: a clip, a noise scale, a
sensitivity, a refusal. For each, `MUTANTS` holds one fault (an exact source snippet and
its faulty replacement) and the fast tests that must catch it. The check copies the
repository's files (tracked and untracked-but-not-ignored) into a temporary directory,
once per parallel job, runs every mutant's tests once on the clean first copy, alone
(they must pass, none skipped), then for each mutant writes the fault into a copy no
other run is using, runs its tests, and restores the file. At most `--jobs` mutant runs
go at once (default: the CPU count, at most 2; `--jobs 1` runs them one after another);
their lines print in `MUTANTS` order. A mutant is caught when pytest reports a failed
test; one that survives, a snippet that no longer matches exactly once, or a run that
errors fails the check with the invariant's name.

Each run imports the project from its copy, never from the checkout (the .venv has the
checkout installed editable): the run prepends the copy to sys.path and fails unless the
mutated module was imported from the copy. By default each run is a fork of this
process, which has imported TensorFlow, TFF and Beam once (no project module: the check
fails if one is loaded before a fork); `--no-fork` starts a fresh interpreter per run
instead (slower, nothing shared). Each run writes one log and leads its own process
group, which is killed when the run passes RUN_TIMEOUT_S or the check is interrupted
(Ctrl-C, SIGTERM).

  .venv/bin/python scripts/mutation_check.py            # all mutants (make mutation-check)
  .venv/bin/python scripts/mutation_check.py --list     # names and tests
  .venv/bin/python scripts/mutation_check.py --only fdml-row-clip --only budget-refusal
  .venv/bin/python scripts/mutation_check.py --jobs 1   # one run at a time

Adding a mutant: docs/development.md, "Mutation check".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Top-level packages of the project: none may be imported before a run starts.
PROJECT_PACKAGES = ("tff_algorithms", "beam_jobs", "pipeline", "tests", "bench", "tools")
# Imported once by the forking parent; what the selected tests import anyway.
PRELOADED = (
    "numpy",
    "tensorflow",
    "tensorflow_federated",
    "tensorflow_privacy",
    "dp_accounting",
    "apache_beam",
    "PIL.Image",
    "pytest",
    "hypothesis",  # pytest's hypothesis plugin imports it: seconds per run otherwise
)
RUN_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One fault: `original` (exactly once in `path`) replaced by `replacement`.

    Attributes:
      name: the invariant, as the report names it.
      path: the file, relative to the repository root.
      original: the exact source text the fault replaces.
      replacement: the faulty text.
      tests: pytest node ids that must catch it, fastest first.
    """

    name: str
    path: str
    original: str
    replacement: str
    tests: tuple[str, ...]

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")


_FDML = "tests/tff_algorithms/algorithms/fdml/test_fdml.py::"
_FDML_PRIVACY = "tests/tff_algorithms/algorithms/fdml/test_fdml_privacy.py::"
_AGGREGATORS = "tests/tff_algorithms/algorithms/dp_fedemb/test_aggregators.py::"
_TREES = "tests/tff_algorithms/privacy/test_tree_sensitivity.py::"
_TIGHT = "tests/tff_algorithms/privacy/test_accounting_tight.py::"
_LOGIT = "tests/tff_algorithms/algorithms/logit_dp/test_logit_dp.py::"
_ALIGNED_LOOKALIKE = "tests/beam_jobs/test_dedup_lookalikes.py::test_an_aligned_look_alike_is_kept_and_an_aligned_copy_is_not"
_CLIPPED_COPY = (
    "tests/beam_jobs/test_dedup_lookalikes.py::"
    "test_a_clipped_brightened_copy_shares_noise_at_the_whole_pixel_alignment"
)
_SHIFTED_FRAME_FILLING_COPY = (
    "tests/beam_jobs/test_dedup_lookalikes.py::"
    "test_a_shifted_brightened_copy_of_a_frame_filling_image_is_the_same_pixels"
)
_FRAME_FILLING_ICONS = (
    "tests/beam_jobs/test_dedup_lookalikes.py::"
    "test_another_render_of_a_frame_filling_icon_is_kept_and_its_resampled_copies_are_not"
)
_CROP_RESIZED_BACK = (
    "tests/beam_jobs/test_dedup_lookalikes.py::"
    "test_a_crop_resized_back_is_its_reference_through_a_filter_and_another_render_is_not"
)

MUTANTS: tuple[Mutant, ...] = (
    # --- clip bounds -----------------------------------------------------------------
    Mutant(
        "aggregator-gaussian-clip",
        "tff_algorithms/algorithms/dp_fedemb/aggregators.py",
        "SeededGaussianSumQuery(clip_norm, clip_norm * noise_multiplier, noise_seed)",
        "SeededGaussianSumQuery(1e9, clip_norm * noise_multiplier, noise_seed)",
        (_AGGREGATORS + "test_each_virtual_client_is_clipped_to_the_bound",),
    ),
    # --- a user's backbone: no example's output depends on another's -----------------
    Mutant(
        "user-backbone-batch-norm-frozen",
        "tff_algorithms/modeling/dp_layers.py",
        "        del training\n        return super().call(inputs, training=False)",
        "        return super().call(inputs, training=training)",
        (
            "tests/tff_algorithms/modeling/test_user_backbones.py::test_a_user_file_with_batch_norm_trains_per_example_in_both_modes[freeze]",
        ),
    ),
    Mutant(
        "user-backbone-unclassified-layer-refused",
        "tff_algorithms/modeling/dp_layers.py",
        '    if isinstance(layer, _PER_EXAMPLE_CLASSES) and type(layer).__name__ != "Lambda":\n        return Kind.PER_EXAMPLE\n',
        "    return Kind.PER_EXAMPLE\n",
        (
            "tests/tff_algorithms/modeling/test_user_backbones.py::test_bad_user_models_are_refused_in_one_line_each",
        ),
    ),
    Mutant(
        "aggregator-tree-clip",
        "tff_algorithms/algorithms/dp_fedemb/aggregators.py",
        "build_l2_gaussian_query(\n        clip_norm,\n        noise_multiplier,",
        "build_l2_gaussian_query(\n        1e9,\n        noise_multiplier * clip_norm / 1e9,",
        (_AGGREGATORS + "test_tree_aggregation_clips_each_virtual_client[None]",),
    ),
    Mutant(
        "user-dp-sgd-clip-per-user-tape",
        "tff_algorithms/algorithms/user_dp_sgd/training.py",
        "factor = tf.minimum(1.0, clip_norm / tf.maximum(norm, 1e-30))",
        "factor = tf.constant(1.0)",
        (
            "tests/tff_algorithms/algorithms/user_dp_sgd/test_user_dp_sgd.py::test_dense_layer_shortcut_equals_one_tape_per_user",
        ),
    ),
    Mutant(
        "user-dp-sgd-clip-dense-shortcut",
        "tff_algorithms/algorithms/user_dp_sgd/training.py",
        "scale = tf.where(finite, tf.minimum(1.0, self._clip / tf.maximum(norm, 1e-30)), 0.0)",
        "scale = tf.where(finite, 1.0, 0.0)",
        (
            "tests/tff_algorithms/algorithms/user_dp_sgd/test_user_dp_sgd.py::test_dense_layer_shortcut_equals_one_tape_per_user",
        ),
    ),
    Mutant(
        "logit-dp-pair-clip",
        "tff_algorithms/algorithms/logit_dp/mechanism.py",
        "    b = tf.constant(clip_norm, norms.dtype)\n",
        "    return tf.ones_like(norms)\n",
        (_LOGIT + "test_lambda_and_row_routes_equal_explicit_clipping[dtype0-1e-09]",),
    ),
    Mutant(
        "logit-dp-pair-clip-row-route",
        "tff_algorithms/algorithms/logit_dp/mechanism.py",
        "coefficients = weights[i] * _clip_factors(norms, clip_norm)",
        "coefficients = weights[i]",
        (_LOGIT + "test_lambda_and_row_routes_equal_explicit_clipping[dtype0-1e-09]",),
    ),
    Mutant(
        "fdml-row-clip",
        "tff_algorithms/algorithms/fdml/protocol.py",
        "    if row_clip is None:\n        return derivatives\n"
        "    return tf.clip_by_norm(derivatives, row_clip, axes=[-1])",
        "    return derivatives",
        (_FDML + "test_every_released_derivative_row_is_clipped_to_row_clip[batch_all]",),
    ),
    Mutant(
        "fdml-gradient-clip",
        "tff_algorithms/algorithms/fdml/protocol.py",
        "gradient, _ = tf.clip_by_global_norm(gradient, gradient_clip, use_norm=norm)",
        "pass",
        (_FDML_PRIVACY + "test_the_numpy_mechanism_is_the_modules[batch_all-2]",),
    ),
    Mutant(
        "dplc-centers-clip",
        "tff_algorithms/privacy/dplc.py",
        "    if not np.any(outside):\n        return w",
        "    if True:\n        return w",
        ("tests/tff_algorithms/privacy/test_dplc.py::test_public_means_match_reference",),
    ),
    # --- noise scale -------------------------------------------------------------------
    Mutant(
        "aggregator-gaussian-noise-scale",
        "tff_algorithms/algorithms/dp_fedemb/aggregators.py",
        "SeededGaussianSumQuery(clip_norm, clip_norm * noise_multiplier, noise_seed)",
        "SeededGaussianSumQuery(clip_norm, 0.7 * clip_norm * noise_multiplier, noise_seed)",
        (_AGGREGATORS + "test_gaussian_noise_std_is_z_gamma_over_m",),
    ),
    Mutant(
        "aggregator-tree-noise-scale",
        "tff_algorithms/algorithms/dp_fedemb/aggregators.py",
        "build_l2_gaussian_query(\n        clip_norm,\n        noise_multiplier,",
        "build_l2_gaussian_query(\n        clip_norm,\n        0.7 * noise_multiplier,",
        (_AGGREGATORS + "test_tree_prefix_sum_noise_follows_the_nodes_summed",),
    ),
    Mutant(
        "dp-ftrl-tree-restart",
        "tff_algorithms/algorithms/dp_fedemb/mechanisms.py",
        "restart_every_rounds = rounds_per_epoch if spec.restart_every_epoch else None",
        "restart_every_rounds = None",
        (
            "tests/tff_algorithms/algorithms/dp_fedemb/test_mechanisms.py::"
            "test_dpftrl_spec_gives_tree_noise_restarting_as_the_spec_says[True]",
        ),
    ),
    Mutant(
        "user-dp-sgd-noise-scale",
        "tff_algorithms/algorithms/user_dp_sgd/training.py",
        "self._stddev = float(noise_multiplier) * float(clip_norm)",
        "self._stddev = 0.7 * float(noise_multiplier) * float(clip_norm)",
        (
            "tests/tff_algorithms/algorithms/user_dp_sgd/test_user_dp_sgd.py::test_step_noise_std_is_z_times_clip_over_users",
        ),
    ),
    Mutant(
        "logit-dp-noise-scale",
        "tff_algorithms/algorithms/logit_dp/mechanism.py",
        "return add_gaussian_noise(clipped_gradient, noise_multiplier * c, seed)",
        "return add_gaussian_noise(clipped_gradient, 0.7 * noise_multiplier * c, seed)",
        (_LOGIT + "test_noise_std_is_sigma_times_c_and_seeded",),
    ),
    Mutant(
        "fdml-derivative-noise-scale",
        "tff_algorithms/algorithms/fdml/protocol.py",
        "    stddev = noise_multiplier * row_clip",
        "    stddev = 0.7 * noise_multiplier * row_clip",
        (_FDML + "test_noise_std_is_z_times_clip",),
    ),
    Mutant(
        "fdml-gradient-noise-scale",
        "tff_algorithms/algorithms/fdml/protocol.py",
        "stddev = config.gradient_noise_multiplier * config.gradient_clip",
        "stddev = 0.7 * config.gradient_noise_multiplier * config.gradient_clip",
        (_FDML + "test_noise_std_is_z_times_clip",),
    ),
    Mutant(
        "dplc-noise-scale",
        "tff_algorithms/privacy/dplc.py",
        "return means + noise_multiplier * delta * rng.standard_normal(means.shape)",
        "return means + 0.7 * noise_multiplier * delta * rng.standard_normal(means.shape)",
        (
            "tests/tff_algorithms/privacy/test_dplc.py::test_noise_matches_sigma_times_sensitivity[False]",
        ),
    ),
    # --- accounting sensitivity --------------------------------------------------------
    Mutant(
        "accounting-substitute-one-sensitivity",
        "tff_algorithms/privacy/accounting_spec.py",
        "return 1.0 if self.convention is Convention.PAPER else 2.0",
        "return 1.0",
        ("tests/tff_algorithms/privacy/test_accounting.py::test_strict_is_the_default_convention",),
    ),
    Mutant(
        "accounting-add-or-remove-virtual-client-sensitivity",
        "tff_algorithms/privacy/accounting_spec.py",
        "return 2.0 if self.users_per_virtual_client > 1 else 1.0",
        "return 1.0",
        (
            "tests/tff_algorithms/privacy/test_accounting.py::test_virtual_clients_halve_noise_under_add_or_remove_relations",
        ),
    ),
    Mutant(
        "release-relative-to-sensitivity",
        "tff_algorithms/privacy/accounting_spec.py",
        "        if self.release.relative_to_sensitivity:\n            return 1.0",
        "        if False:\n            return 1.0",
        (_FDML_PRIVACY + "test_the_jobs_spec_charges_what_fdmls_own_event_costs",),
    ),
    # --- the tight PLD of fixed-size sampling (docs/privacy.md) --------------------------
    Mutant(
        "wor-pld-sampling-rate",
        "tff_algorithms/privacy/accounting.py",
        "        spec.users_per_round / spec.population,\n        spec.effective_noise_multiplier,",
        "        0.5 * spec.users_per_round / spec.population,\n        spec.effective_noise_multiplier,",
        (
            _TIGHT
            + "test_product_epsilon_matches_independent_composition[2994-384-20-1.773-0.0001]",
        ),
    ),
    Mutant(
        "wor-pld-noise-scale",
        "tff_algorithms/privacy/accounting.py",
        "        spec.effective_noise_multiplier,\n        spec.rounds,\n        PLD_DISCRETIZATION,",
        "        1.3 * spec.effective_noise_multiplier,\n        spec.rounds,\n        PLD_DISCRETIZATION,",
        (
            _TIGHT
            + "test_product_epsilon_matches_independent_composition[2994-384-20-1.773-0.0001]",
        ),
    ),
    Mutant(
        "tree-sensitivity-single-tree",
        "tff_algorithms/privacy/tree_sensitivity.py",
        "    return 2.0 * float(",
        "    return 1.0 * float(",
        (_TREES + "test_single_tree_sensitivity_is_the_brute_force_worst_case[8-3]",),
    ),
    Mutant(
        "tree-sensitivity-restarted-tree-depth",
        "tff_algorithms/privacy/tree_sensitivity.py",
        "return leaves.bit_length()",
        "return leaves.bit_length() - 1",
        (_TREES + "test_restarted_tree_sensitivity_is_the_brute_force_worst_case[2-5]",),
    ),
    Mutant(
        "tree-sensitivity-closed-form-bound",
        "tff_algorithms/privacy/tree_sensitivity.py",
        "total += full * most**2 + rest**2",
        "total += full * most + rest",
        (_TREES + "test_single_tree_sensitivity_is_the_brute_force_worst_case[13-2]",),
    ),
    Mutant(
        "logit-dp-substitute-one-row-term",
        "tff_algorithms/algorithms/logit_dp/sensitivity.py",
        "    rows = {NeighboringRelation.REPLACE_ONE: 4.0, NeighboringRelation.ADD_OR_REMOVE_ONE: 2.0}\n"
        "    t = math.exp(2.0 * scale)",
        "    rows = {NeighboringRelation.REPLACE_ONE: 2.0, NeighboringRelation.ADD_OR_REMOVE_ONE: 2.0}\n"
        "    t = math.exp(2.0 * scale)",
        (_LOGIT + "test_worst_case_search_reaches_but_never_exceeds_the_bound[2]",),
    ),
    Mutant(
        "fdml-derivative-sensitivity",
        "tff_algorithms/algorithms/fdml/privacy.py",
        "return 2.0 * float(row_clip) * math.sqrt(users_per_group * samples_per_user)",
        "return float(row_clip) * math.sqrt(users_per_group * samples_per_user)",
        (
            _FDML_PRIVACY + "test_no_neighbour_moves_a_release_more_than_the_accountant_assumes"
            "[2-batch_all]",
        ),
    ),
    Mutant(
        "fdml-gradient-sensitivity",
        "tff_algorithms/algorithms/fdml/privacy.py",
        "return 2.0 * float(gradient_clip)",
        "return float(gradient_clip)",
        (
            _FDML_PRIVACY + "test_no_neighbour_moves_a_release_more_than_the_accountant_assumes"
            "[2-batch_all]",
        ),
    ),
    # --- budget refusal and dedup verification -----------------------------------------
    Mutant(
        "budget-refusal",
        "tff_algorithms/privacy/budget.py",
        "over = not spent_after <= budget_epsilon",
        "over = False",
        (
            "tests/tff_algorithms/privacy/test_budget_ledger.py::"
            "test_charging_accumulates_refuses_over_budget_and_records_an_override",
        ),
    ),
    Mutant(
        "budget-fixed-by-first-charge",
        "tff_algorithms/privacy/budget.py",
        "budget_changed = budget_epsilon != policy.total_epsilon",
        "budget_changed = False",
        (
            "tests/tff_algorithms/privacy/test_budget_ledger.py::"
            "test_the_budget_is_fixed_by_the_first_charge_and_a_change_is_an_override",
        ),
    ),
    # The ledger's tamper evidence (issue 63): its chain, the budget in the first link,
    # and the cross-check against the product's own records of each charge.
    Mutant(
        "budget-chain-verified",
        "tff_algorithms/privacy/budget_chain.py",
        "if problem is not None and not accept_repair:",
        "if False:",
        (
            "tests/tff_algorithms/privacy/test_budget_chain.py::"
            "test_each_edit_of_budget_or_spec_is_refused_naming_the_entry",
        ),
    ),
    Mutant(
        "budget-chain-fixes-the-budget",
        "tff_algorithms/privacy/budget_chain.py",
        "return _digest(CHAIN_SCHEME, fingerprint, budget)",
        "return _digest(CHAIN_SCHEME, fingerprint)",
        (
            "tests/tff_algorithms/privacy/test_budget_chain.py::"
            "test_each_edit_of_budget_or_spec_is_refused_naming_the_entry",
        ),
    ),
    Mutant(
        "budget-ledger-cross-checked",
        "tff_algorithms/privacy/budget_chain.py",
        "if mismatches and not accept_repair:",
        "if False:",
        (
            "tests/tff_algorithms/privacy/test_budget_chain.py::"
            "test_a_deleted_last_entry_is_refused_against_what_the_product_recorded",
        ),
    ),
    Mutant(
        "dedup-verification",
        "beam_jobs/dedup_verification.py",
        "for i in np.flatnonzero([e is not None for e in evidence]):",
        "for i in range(len(pairs)):",
        (
            "tests/beam_jobs/test_dedup.py::test_copies_of_evaluation_images_are_removed_and_nothing_else",
        ),
    ),
    # The split protocols: an evaluation identity's records in public pretraining, and a
    # user's records in two splits.
    Mutant(
        "split-public-user-takes-evaluation-identities",
        "beam_jobs/splits.py",
        "if public_user and split == split_protocols.TRAIN:",
        "if public_user:",
        (
            "tests/beam_jobs/test_splits.py::"
            "test_identity_mode_keeps_every_record_and_keeps_evaluation_identities_out_of_training",
        ),
    ),
    Mutant(
        "split-user-in-two-splits",
        "beam_jobs/splits.py",
        "        if split == user_split_:",
        "        if True:",
        ("tests/beam_jobs/test_splits.py::test_splits_are_disjoint_by_user_and_identity",),
    ),
    # A look-alike taken for a copy: the copy evidence's two tests.
    Mutant(
        "dedup-shared-noise",
        "beam_jobs/dedup_verification.py",
        "found.append(_SHARED if correlation >= config.min_shared_noise else _NOT_SHARED)",
        "found.append(_SHARED)",
        (_ALIGNED_LOOKALIKE,),
    ),
    # A copy taken for a look-alike: the whole-pixel alignment of clipped copies.
    Mutant(
        "dedup-whole-pixel-alignment",
        "beam_jobs/dedup_verification.py",
        "if whole is not None and whole != alignment:",
        "if False:",
        (_CLIPPED_COPY,),
    ),
    # Both ways for the same_pixels evidence: a copy with few flat pixels kept, or any
    # aligned look-alike taken for a copy.
    Mutant(
        "dedup-same-pixels-skipped",
        "beam_jobs/dedup_verification.py",
        "elif same_pixels[i]:",
        "elif False:",
        (_SHIFTED_FRAME_FILLING_COPY,),
    ),
    Mutant(
        "dedup-same-pixels-tolerance",
        "beam_jobs/dedup_verification.py",
        "<= copy_evidence.SAME_PIXELS_TOLERANCE",
        '<= float("inf")',
        (_SHIFTED_FRAME_FILLING_COPY,),
    ),
    # Both ways for the prediction check on the detail allowance: every resampled copy
    # vetoed (copies kept: the privacy fault), or none (another render removed).
    Mutant(
        "dedup-prediction-vetoes-copies",
        "beam_jobs/dedup_verification.py",
        "> copy_prediction.MAX_UNEXPLAINED",
        ">= 0.0",
        (_FRAME_FILLING_ICONS,),
    ),
    Mutant(
        "dedup-prediction-skipped",
        "beam_jobs/dedup_verification.py",
        'and measured["residual"][i] > config.max_residual\n'
        "            and unexplained[i] > copy_prediction.MAX_UNEXPLAINED\n",
        "and False\n",
        (_FRAME_FILLING_ICONS,),
    ),
    # Both ways for predicted_pixels: a resampled copy kept, or another render removed.
    Mutant(
        "dedup-predicted-pixels-skipped",
        "beam_jobs/dedup_verification.py",
        "<= copy_prediction.MAX_PREDICTED",
        "<= -1.0",
        (_CROP_RESIZED_BACK,),
    ),
    Mutant(
        "dedup-predicted-pixels-tolerance",
        "beam_jobs/dedup_verification.py",
        "<= copy_prediction.MAX_PREDICTED",
        '<= float("inf")',
        (_CROP_RESIZED_BACK,),
    ),
    Mutant(
        "dedup-jpeg-reencode",
        "beam_jobs/dedup_verification.py",
        '"jpeg_reencode" if difference <= config.jpeg_tolerance else None',
        '"jpeg_reencode"',
        (_ALIGNED_LOOKALIKE,),
    ),
)


@dataclasses.dataclass(frozen=True)
class RunResult:
    exit_code: int
    failed: tuple[str, ...]
    skipped: int
    imported: dict[str, str | None]
    log: Path
    seconds: float


# --- one pytest run (in a fork or a fresh interpreter) -----------------------------------


def _child(
    copy: Path, tests: Sequence[str], modules: Sequence[str], stop_first: bool, log: Path
) -> int:
    """Runs pytest on `tests` in `copy`; writes {exit_code, imported} next to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT_PACKAGES)
    if loaded:
        print(f"mutation_check: project modules loaded before the run: {loaded}", flush=True)
        return 98
    # The copy's code, and no bytecode: a rewritten file of the same size within the
    # same second could otherwise be served from a stale cache.
    sys.dont_write_bytecode = True
    os.chdir(copy)
    sys.path.insert(0, str(copy))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(copy), os.environ.get("PYTHONPATH")])
    )
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    import pytest

    args = ["-q", "-rfs", "-p", "no:cacheprovider", *(["-x"] if stop_first else []), *tests]
    exit_code = int(pytest.main(args))
    imported = {m: getattr(sys.modules.get(m), "__file__", None) for m in modules}
    log.with_suffix(".json").write_text(json.dumps({"exit_code": exit_code, "imported": imported}))
    sys.stdout.flush()
    sys.stderr.flush()
    return exit_code


@dataclasses.dataclass
class _Running:
    """A started run: its process (the leader of its own process group) and deadline."""

    pid: int
    log: Path
    started: float
    deadline: float


def _start(
    copy: Path,
    tests: Sequence[str],
    modules: Sequence[str],
    stop_first: bool,
    log: Path,
    fork: bool,
) -> _Running:
    """Forks a run; without `fork` the child execs a fresh interpreter at once."""
    log.with_suffix(".json").unlink(missing_ok=True)
    request = json.dumps(
        {
            "copy": str(copy),
            "tests": list(tests),
            "modules": list(modules),
            "stop_first": stop_first,
            "log": str(log),
        }
    )
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)  # its own group: a timed-out or interrupted run dies with its workers
        code = 99
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler
            if fork:
                code = _child(copy, tests, modules, stop_first, log)
            else:
                os.execv(sys.executable, [sys.executable, __file__, "--child", request])
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return _Running(pid, log, started, started + RUN_TIMEOUT_S)


def _poll(running: _Running) -> int | None:
    """The run's exit status once it has ended, -1 once killed for its timeout, else None."""
    done, status = os.waitpid(running.pid, os.WNOHANG)
    if done:
        return os.waitstatus_to_exitcode(status)
    if time.monotonic() > running.deadline:
        _kill(running)
        return -1
    return None


def _kill(running: _Running) -> None:
    try:
        os.killpg(running.pid, signal.SIGKILL)
    except ProcessLookupError:  # its group has already gone
        pass
    os.waitpid(running.pid, 0)


def _result(running: _Running, exit_code: int) -> RunResult:
    log, result_file = running.log, running.log.with_suffix(".json")
    text = log.read_text(errors="replace") if log.exists() else ""
    imported = json.loads(result_file.read_text())["imported"] if result_file.exists() else {}
    failed = tuple(re.findall(r"^FAILED (\S+)", text, re.MULTILINE))
    skipped = len(re.findall(r"^SKIPPED ", text, re.MULTILINE))
    return RunResult(exit_code, failed, skipped, imported, log, time.monotonic() - running.started)


# --- the check ------------------------------------------------------------------------


def _copy_repository(repo: Path, target: Path) -> None:
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=repo,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = repo / name
        if source.is_file() and not source.is_symlink():  # deleted in the work tree: skip
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _drifted(copy: Path, mutants: Sequence[Mutant]) -> list[str]:
    problems = []
    for mutant in mutants:
        path = copy / mutant.path
        count = path.read_text().count(mutant.original) if path.is_file() else 0
        if count != 1:
            problems.append(
                f"mutant {mutant.name}: its snippet occurs {count} times in {mutant.path} "
                "(the source drifted: update the mutant in scripts/mutation_check.py)"
            )
    return problems


def _outside_copy(result: RunResult, copy: Path, modules: Sequence[str]) -> list[str]:
    return [
        f"{m} imported from {result.imported.get(m)}, not from the copy"
        for m in modules
        if not (result.imported.get(m) or "").startswith(str(copy) + os.sep)
    ]


def _tail(log: Path, lines: int = 30) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join("    " + line for line in text[-lines:])


def _wait(running: _Running) -> int:
    try:
        while (exit_code := _poll(running)) is None:
            time.sleep(0.2)
    except BaseException:  # interrupted: the run must not outlive the check
        _kill(running)
        raise
    return exit_code


def _report(mutant: Mutant, run: RunResult, copy: Path) -> str:
    """Prints the mutant's line; returns "caught", "survived" or "error"."""
    wrong = _outside_copy(run, copy, [mutant.module])
    if wrong or run.exit_code not in (0, 1) or (run.exit_code == 1 and not run.failed):
        print(
            f"  ERROR    {mutant.name}: exit {run.exit_code} {'; '.join(wrong)} "
            f"({run.seconds:.0f} s)\n{_tail(run.log)}"
        )
        return "error"
    if run.exit_code == 0:
        print(f"  SURVIVED {mutant.name}: {mutant.path} ({run.seconds:.0f} s)")
        return "survived"
    print(f"  caught   {mutant.name} by {run.failed[0]} ({run.seconds:.0f} s)")
    return "caught"


def _run_mutants(
    mutants: Sequence[Mutant], copies: Sequence[Path], logs: Path, fork: bool
) -> dict[str, list[str]]:
    """Runs each mutant in a copy no other run is using, at most one run per copy at
    once; prints the mutants' lines in `mutants` order; returns their names by verdict."""
    free = list(copies)
    running: dict[int, tuple[_Running, Path, str]] = {}  # index: run, its copy, the file
    finished: dict[int, tuple[RunResult, Path]] = {}
    verdicts: dict[str, list[str]] = {"caught": [], "survived": [], "error": []}
    started = printed = 0
    try:
        while printed < len(mutants):
            while free and started < len(mutants):
                mutant, copy = mutants[started], free.pop()
                path = copy / mutant.path
                original = path.read_text()
                path.write_text(original.replace(mutant.original, mutant.replacement))
                log = logs / f"{mutant.name}.log"
                running[started] = (
                    _start(copy, mutant.tests, [mutant.module], True, log, fork),
                    copy,
                    original,
                )
                started += 1
            for index, (run, copy, original) in list(running.items()):
                exit_code = _poll(run)
                if exit_code is not None:
                    (copy / mutants[index].path).write_text(original)
                    del running[index]
                    free.append(copy)
                    finished[index] = (_result(run, exit_code), copy)
            while printed in finished:
                run_result, copy = finished.pop(printed)
                verdicts[_report(mutants[printed], run_result, copy)].append(mutants[printed].name)
                printed += 1
            if running:
                time.sleep(0.2)
    finally:  # interrupted: no run may outlive the check
        for run, _, _ in running.values():
            _kill(run)
    return verdicts


def check(
    mutants: Sequence[Mutant],
    fork: bool,
    jobs: int = 1,
    repo: Path = REPO,
    preload: Sequence[str] = PRELOADED,
) -> int:
    """Runs the check with at most `jobs` mutant runs at once, each in its own copy of
    `repo`; prints a line per mutant and a verdict; returns the exit status."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutation_check_") as tmp:
        copies = [Path(tmp) / f"repo-{i}" for i in range(1, max(1, min(jobs, len(mutants))) + 1)]
        logs = Path(tmp) / "logs"
        copies[0].mkdir()
        logs.mkdir()
        _copy_repository(repo, copies[0])
        problems = _drifted(copies[0], mutants)
        if problems:
            print("\n".join(problems))
            return 2
        for copy in copies[1:]:
            shutil.copytree(copies[0], copy, symlinks=True)
        if fork:
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for name in preload:
                    __import__(name)
        modules = sorted({m.module for m in mutants})
        selection = list(dict.fromkeys(t for m in mutants for t in m.tests))
        print(
            f"mutation check: {len(mutants)} mutants, {len(selection)} tests, "
            f"{len(copies)} at once, in {tmp}"
        )
        clean_start = _start(copies[0], selection, modules, False, logs / "clean.log", fork)
        clean = _result(clean_start, _wait(clean_start))
        wrong = _outside_copy(clean, copies[0], modules)
        if clean.exit_code != 0 or clean.skipped or wrong:
            print(
                f"clean copy: the selected tests must all pass and none be skipped (exit "
                f"{clean.exit_code}, {clean.skipped} skipped, failed {list(clean.failed)}) "
                f"{'; '.join(wrong)}\n{_tail(clean.log)}"
            )
            return 2
        print(f"  clean copy: {len(selection)} tests pass ({clean.seconds:.0f} s)")
        verdicts = _run_mutants(mutants, copies, logs, fork)
    minutes = (time.monotonic() - started) / 60
    survivors, errors = verdicts["survived"], verdicts["error"]
    if survivors or errors:
        print(
            f"mutation check FAILED ({minutes:.1f} min): no test catches "
            f"{', '.join(survivors) or 'none'}; runs in error: {', '.join(errors) or 'none'}"
        )
        return 1
    print(f"mutation check passed: all {len(mutants)} mutants caught ({minutes:.1f} min)")
    return 0


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the check, which kills its runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run this mutant only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--no-fork", action="store_true", help="a fresh interpreter per run (slower)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(os.cpu_count() or 1, 2),
        help="mutant runs at once, each in its own copy (default: the CPU count, at most 2)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        request = json.loads(args.child)
        return _child(
            Path(request["copy"]),
            request["tests"],
            request["modules"],
            request["stop_first"],
            Path(request["log"]),
        )
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more")
    mutants = list(MUTANTS)
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTANTS})
        if unknown:
            parser.error(f"unknown mutant(s) {unknown}; --list shows the names")
        mutants = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for mutant in mutants:
            print(f"{mutant.name}: {mutant.path} -> {', '.join(mutant.tests)}")
        return 0
    sys.stdout.reconfigure(line_buffering=True)  # progress shows as it happens in CI logs
    signal.signal(signal.SIGTERM, _terminated)
    try:
        return check(mutants, fork=not args.no_fork, jobs=args.jobs)
    except KeyboardInterrupt:
        print("mutation check interrupted; its runs were killed")
        return 130


if __name__ == "__main__":
    sys.exit(main())
