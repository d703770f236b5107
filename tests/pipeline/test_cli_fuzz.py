"""Property-based fuzzing of every `dp-fedemb` command through its real entry point (issue 29).

Each case builds a command line (flags and `--set` config keys with hostile values: other
types, boundaries, NaN/±inf, huge and negative numbers, empty and unicode strings, and
paths: a file where a directory is expected, an unwritable directory, a symlink loop, a
missing parent), runs `pipeline.cli.main` in-process with stdout/stderr captured, and
accepts exactly two outcomes: exit 0, or a non-zero exit with one line on stderr. No
traceback, no exception out of `main`, no file written outside the sandbox's `out*`
paths, no existing file changed.

Cases never start real work: `privacy` and `--help` are cheap, `run` prints its config
(`--print-config`) or carries one invalid item, and `train`, `data`, `evaluate` and
`compile` always carry one invalid item (a "poison": a missing input, an output that is
a file, ...), so they exercise the checks and stop before anything heavy. A generous
per-case alarm catches hangs; it is not a timing threshold.

Few examples by default (CI, about a minute on 2 cores); DP_FEDEMB_FUZZ_EXAMPLES=N runs N
per command. Cases found by the fuzzer live on as the explicit regression tests below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import cli
from pipeline import config as config_lib
from tests import paths
from tff_algorithms.config import job_config

EXAMPLES = int(os.environ.get("DP_FEDEMB_FUZZ_EXAMPLES", "8"))
CASE_TIMEOUT_S = 300
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

# Hostile scalar texts, as a user could type them.
HOSTILE_TEXT = [
    "",
    " ",
    "0",
    "-0",
    "1",
    "-1",
    "2",
    "3",
    "0.5",
    "1e-5",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "+inf",
    "1e308",
    "1e309",
    "-1e308",
    "1e-320",
    "9" * 40,
    "-" + "9" * 40,
    "2147483648",
    "9223372036854775808",
    "0x10",
    "1_000",
    "true",
    "false",
    "yes",
    "auto",
    "None",
    "null",
    "[]",
    "{}",
    "é",
    "日本語",
    "\u202e",
    "a\nb",
    "\x00",
    "\x1b[31m",
    "--",
    "-",
    "=",
    "'",
    '"',
    "%s",
    "../..",
    "~",
    "dp-fedemb",
    "dpftrl",
    "cosface",
    "small_cnn",
]
HOSTILE_YAML = [
    ".nan",
    ".inf",
    "-.inf",
    "1e400",
    "[1, 2]",
    "{a: 1}",
    "[]",
    "~",
    "!!binary AAAA",
    "&a [*a]",
    "!!python/object:os.system {}",
    "'unterminated",
    "{",
    "]",
    "- a",
    "2000-01-01",
    "0o17",
]


def _text():
    return st.one_of(
        st.sampled_from(HOSTILE_TEXT),
        st.integers(-(2**70), 2**70).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.text(max_size=10),
    )


def _path_names() -> list[str]:
    """Paths relative to the sandbox (see `sandbox`); the first ones are invalid."""
    names = [
        "file.txt",  # a regular file where a directory is expected
        "file.txt/sub",  # a missing directory under a file
        "loop1",  # a symlink loop
        "loop1/x",
        "broken",  # a broken symlink
        "/proc/dp-fedemb-fuzz/out",  # unwritable even for root
        "",
    ]
    if not IS_ROOT:
        names.append("ro/sub")  # an unwritable directory (root passes permission bits)
    return names


INVALID_OUTPUT_DIRS = _path_names()
INVALID_INPUTS = ["missing", "missing/parent/x", "loop1", "broken", ""]
VALID_OUTPUT_DIRS = ["out", "out/new/deeper", "out/日本語", "out/\u202e"]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working directory holding the fixtures the paths point at."""
    (tmp_path / "file.txt").write_text("keep me\n")
    (tmp_path / "empty_dir").mkdir()
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "inside.txt").write_text("read only\n")
    os.symlink("loop2", tmp_path / "loop1")
    os.symlink("loop1", tmp_path / "loop2")
    os.symlink("nowhere", tmp_path / "broken")
    (tmp_path / "config.yaml").write_text("train:\n  rounds: 3\n")
    (tmp_path / "bad.yaml").write_text("train: [\n")
    ro.chmod(0o555)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    ro.chmod(0o755)


def _snapshot(root: Path) -> dict[str, tuple]:
    state = {}
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            digest = ""
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            state[os.path.relpath(path, root)] = (info.st_mode, info.st_size, digest)
    return state


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout(f"no answer within {CASE_TIMEOUT_S} s")


def invoke(root: Path, argv: list[str]) -> tuple[int, str, str]:
    """`dp-fedemb argv` in-process; asserts the one-line contract and the file rules."""
    before = _snapshot(root)
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["dp-fedemb", *argv])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    stdout, stderr = out.getvalue(), err.getvalue()
    assert "Traceback" not in stdout + stderr, (argv, stderr)
    if code != 0:
        assert stderr.count("\n") == 1 and stderr.startswith("dp-fedemb"), (argv, stderr)
    after = _snapshot(root)
    for path, state in before.items():
        assert after.get(path) == state, f"{argv}: {path} changed or vanished"
    for path in set(after) - set(before):
        assert path.split(os.sep)[0] == "out", f"{argv}: wrote {path} outside the output dir"
    return code, stdout, stderr


def _flag(name: str, value: str) -> str:
    return f"--{name}={value}"


def _command_flags(command: str) -> dict[str, str]:
    """Flag name -> absl flag type of a command ('bool', 'int', 'float', 'str', ...)."""
    from absl import flags

    module = __import__(cli.COMMANDS[command], fromlist=["define_flags"])
    flag_values = flags.FlagValues()
    module.define_flags(flag_values)
    return {name: flag_values[name].flag_type() for name in flag_values}


def _fuzzed_flags(draw, command: str, exclude: set[str]) -> list[str]:
    names = sorted(set(_command_flags(command)) - exclude)
    chosen = draw(st.lists(st.sampled_from(names), max_size=6, unique=True))
    argv = []
    for name in chosen:
        if draw(st.booleans()) and _command_flags(command)[name] == "bool":
            argv.append(draw(st.sampled_from([f"--{name}", f"--no{name}"])))
        else:
            argv.append(_flag(name, draw(_text())))
    return argv


# privacy: cheap whatever the values (bounded accounting), so nothing is poisoned. The
# exact tree search of dpftrl is kept off 50..1000 rounds (seconds per case).
PRIVACY_INTS = ["-1", "0", "1", "2", "7", "10", "1000000000", "1000000001", "9" * 30]


@st.composite
def privacy_argv(draw):
    base = {
        "users": draw(st.sampled_from([*PRIVACY_INTS, "1000", "10000000000"])),
        "users-per-round": draw(st.sampled_from([*PRIVACY_INTS, "100"])),
        "rounds": draw(st.sampled_from(PRIVACY_INTS)),
        "delta": draw(st.sampled_from(["1e-5", "0", "1", "nan", "1e-101", "-1e-5", "0.5"])),
    }
    if draw(st.booleans()):
        base["noise-multiplier"] = draw(
            st.sampled_from(["1", "0", "1e308", "1e160", "nan", "inf", "-1", "1e6", "1e-9"])
        )
    else:
        base["target-epsilon"] = draw(
            st.sampled_from(["1", "1e300", "0", "-1", "nan", "inf", "100", "1e-9"])
        )
    argv = ["privacy", *(_flag(k, v) for k, v in base.items() if draw(st.integers(0, 9)))]
    argv.append(_flag("mechanism", draw(st.sampled_from(["dpsgd", "dpftrl", "dpsdg", ""]))))
    extra = {"users", "users-per-round", "rounds", "delta", "noise-multiplier", "mechanism"}
    extra |= {"target-epsilon", "min-separation", "calibration-tolerance"}
    argv += _fuzzed_flags(draw, "privacy", extra)
    return argv


@st.composite
def train_argv(draw):
    """Never trains: data or output is invalid, or the budget flags disagree."""
    poison = draw(st.sampled_from(["data", "output", "budget"]))
    data = draw(st.sampled_from(INVALID_INPUTS + ["file.txt"])) if poison == "data" else "empty_dir"
    output = draw(st.sampled_from(INVALID_OUTPUT_DIRS if poison == "output" else VALID_OUTPUT_DIRS))
    argv = ["train", _flag("data", data), _flag("output", output)]
    if poison == "budget":
        argv.append("--override-budget")
    exclude = {"data", "output", "budget-ledger", "dataset-budget-epsilon", "override-budget"}
    return argv + _fuzzed_flags(draw, "train", exclude)


@st.composite
def data_argv(draw):
    """Never runs a Beam job: the verb, --out or --input is invalid."""
    verb = draw(st.sampled_from(["synth", "ingest", "split", "dedup", "partition", "synt"]))
    input_verb = verb in ("ingest", "split", "dedup", "partition")
    poisons = ["out", *(["input"] if input_verb else [])]
    poison = "verb" if verb == "synt" else draw(st.sampled_from(poisons))
    out = draw(st.sampled_from(INVALID_OUTPUT_DIRS if poison == "out" else VALID_OUTPUT_DIRS))
    argv = ["data", verb, _flag("out", out)]
    if input_verb:
        source = draw(st.sampled_from(INVALID_INPUTS if poison == "input" else ["empty_dir"]))
        argv.append(_flag("input", source))
    return argv + _fuzzed_flags(draw, "data", {"out", "input"})


@st.composite
def evaluate_argv(draw):
    model = draw(st.sampled_from([*INVALID_INPUTS, "file.txt"]))
    argv = ["evaluate", _flag("model", model), _flag("data", draw(st.sampled_from(["empty_dir"])))]
    return argv + _fuzzed_flags(draw, "evaluate", {"model", "data"})


def _config_keys() -> list[str]:
    keys = []
    for field in dataclasses.fields(config_lib.PipelineConfig):
        if dataclasses.is_dataclass(field.type) or isinstance(field.default, object):
            default = getattr(config_lib.PipelineConfig(), field.name)
            if dataclasses.is_dataclass(default):
                keys += [f"{field.name}.{f.name}" for f in dataclasses.fields(default)]
    keys += [f"train.{field.name}" for field in dataclasses.fields(job_config.TrainJobConfig)]
    keys += ["pretrain.job.rounds", "data.synthetic.identities", "nosuch.key", "train"]
    return keys


CONFIG_KEYS = _config_keys()


@st.composite
def set_items(draw):
    items = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(CONFIG_KEYS))
        value = draw(st.one_of(st.sampled_from(HOSTILE_YAML), _text()))
        items.append(_flag("set", f"{key}={value}"))
    return items


@st.composite
def run_argv(draw):
    """--print-config (validates, writes nothing), or a refused run: an unknown key."""
    argv = ["run", *draw(set_items())]
    if draw(st.booleans()):
        argv.append("--print-config")
    else:
        argv.append(_flag("set", "nosuch.key=1"))
    if draw(st.booleans()):
        argv.append(_flag("config", draw(st.sampled_from(["config.yaml", "bad.yaml", "missing"]))))
    if draw(st.booleans()):
        argv.append(_flag("output", draw(st.sampled_from(INVALID_OUTPUT_DIRS + ["out"]))))
    return argv


@st.composite
def compile_argv(draw):
    """Never compiles: the target is missing or the output file is invalid."""
    target = draw(st.sampled_from(["kubeflow", "airflow", "kubflow", ""]))
    out = draw(st.sampled_from(["empty_dir", "file.txt/x", "loop1", "", "/proc/dp-fedemb/x.json"]))
    argv = ["compile", _flag("target", target), _flag("out", out)]
    if draw(st.booleans()):
        argv += draw(set_items())
    return argv + _fuzzed_flags(draw, "compile", {"target", "out", "set"})


@st.composite
def help_or_junk_argv(draw):
    """--help, or junk that ends in a stray positional (so `run` never starts for real:
    a bare `dp-fedemb run` runs the whole default pipeline)."""
    command = draw(st.sampled_from([*cli.COMMANDS, "trian", "", "-x", "日本"]))
    junk = draw(st.lists(_text(), max_size=2))
    if draw(st.booleans()):
        return [command, draw(st.sampled_from(["--help", "-h", "--helpfull"])), *junk]
    return [command, *junk, draw(st.sampled_from(["--nosuchflag=1", "stray-positional"]))]


STRATEGIES = {
    "privacy": privacy_argv(),
    "train": train_argv(),
    "data": data_argv(),
    "evaluate": evaluate_argv(),
    "run": run_argv(),
    "compile": compile_argv(),
    "help": help_or_junk_argv(),
}


@pytest.mark.parametrize("command", sorted(STRATEGIES))
def test_every_command_answers_with_exit_0_or_one_line(command, sandbox):
    @FUZZ
    @given(STRATEGIES[command])
    def property_(argv):
        code, _, _ = invoke(sandbox, argv)
        if command in ("train", "data", "evaluate", "compile"):
            assert code != 0, f"{argv}: a poisoned case must be refused"

    property_()


# Regression cases (issue 29's five, and what the fuzzer found), each one line.
PRIVACY_BASE = ["privacy", "--users=1000", "--users-per-round=100", "--delta=1e-5"]
REGRESSIONS = [
    (PRIVACY_BASE + ["--rounds=10", "--noise-multiplier=1e308"], "--noise-multiplier must be"),
    (PRIVACY_BASE + ["--rounds=10", "--noise-multiplier=1e160"], "--noise-multiplier must be"),
    (PRIVACY_BASE + ["--rounds=10", "--target-epsilon=1e300"], "--target-epsilon must be"),
    (["train", "--data=empty_dir", "--output=file.txt"], "is an existing file"),
    (["train", "--data=empty_dir", "--output=out", "--override-budget"], "--budget-ledger"),
    (["train", "--data=empty_dir", "--output=loop1"], "--output loop1"),
    (["train", "--data=empty_dir", "--output=file.txt/sub"], "is a file"),
    (["train", "--data=empty_dir", "--output=/proc/dp-fedemb-fuzz/out"], "cannot be made"),
    (["train", "--data=empty_dir", "--output=out", "--rounds=0"], "--rounds must be"),
    (["train", "--data=empty_dir", "--output=out", "--clip-norm=nan"], "finite"),
    (["train", "--data=empty_dir", "--output=out", "--channels=2"], "--channels"),
    (["train", "--data=empty_dir", "--output=out", "--algorithm=dp-fedem"], "did you mean"),
    (["train", "--data=empty_dir", "--output=out", "--rounds=" + "9" * 40], "digits"),
    (["train", "--data=missing", "--output=out"], "--data missing does not exist"),
    (["train", "--data=\x00", "--output=out"], "NUL"),
    (["data", "synth", "--out=file.txt"], "--out file.txt"),
    (["data", "synt", "--out=out"], "did you mean synth"),
    (["data", "split", "--input=loop1", "--out=out"], "--input loop1"),
    (["evaluate", "--model=missing", "--data=empty_dir"], "--model missing"),
    (["compile", "--target=airflow", "--out=empty_dir"], "is a directory"),
    (["compile", "--target=kubflow", "--out=x.json"], "did you mean kubeflow"),
    # Found by the fuzzer: /proc passes os.access, and TFX failed making the directory.
    (["compile", "--target=kubeflow", "--out=/proc/dp-fedemb/x.json"], "cannot be"),
    (["run", "--set=train.rounds=.nan", "--print-config"], "finite"),
    (["run", "--set=train.roundz=1"], "did you mean rounds"),
    (["run", "--set=train.rounds=five"], "must be an integer"),
    (["run", "--set=train.head_loss=cosfase"], "did you mean cosface?"),
    (["run", "--set=pretrain.source=publik"], "did you mean public?"),
    (["train", "--data=empty_dir", "--output=out", "--architecture=resnet5"], "resnet50"),
    (["run", "--config=bad.yaml"], "not valid YAML"),
    (["run", "--output=file.txt", "--print-config"], "is an existing file"),
    (["privacy", "--user=5"], "did you mean --users"),
    (["privacy", *PRIVACY_BASE[1:], "--rounds=1", "--mechanism=dpsdg"], "did you mean dpsgd"),
    (["trian"], "did you mean train"),
]


@pytest.mark.parametrize("argv, message", REGRESSIONS, ids=[" ".join(a) for a, _ in REGRESSIONS])
def test_regressions_are_one_line_refusals(argv, message, sandbox):
    code, _, err = invoke(sandbox, argv)
    assert code != 0 and message in err, err


def test_help_shows_effective_defaults_and_bounds(sandbox):
    code, out, _ = invoke(sandbox, ["train", "--help"])
    out = " ".join(out.split())
    assert code == 0
    assert "(effective default: 20 with --recipe=default, 200 with --recipe=paper)" in out
    assert "1 to 1e+09" in out and "0 to 1e+06" in out and "(0, 100]" in out
    code, out, _ = invoke(sandbox, ["privacy", "--help"])
    out = " ".join(out.split())
    assert code == 0 and "1 to 1e+10" in out and "[1e-100, 1)" in out


def test_flag_errors_come_before_tensorflow_in_a_fresh_process(sandbox):
    """The issue's slow refusal, in a fresh interpreter: nothing heavy is imported."""
    probe = (
        "import sys\n"
        "from pipeline import cli\n"
        "code = cli.main(['dp-fedemb', 'train', '--data=empty_dir', '--output=out', "
        "'--override-budget'])\n"
        "heavy = [m for m in ('tensorflow', 'tensorflow_federated', 'apache_beam', 'tfx') "
        "if m in sys.modules]\n"
        "print(code, heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=sandbox,
        env={**os.environ, "PYTHONPATH": str(paths.REPO)},
    )
    assert done.stdout.strip() == "1 []", done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "--budget-ledger" in done.stderr


@pytest.mark.slow
def test_bench_cli_quick_answers_every_case_in_one_line():
    """bench/bench_cli.py's cases, one fresh process each: what BENCHMARKS.md times is
    what the contract says (help exits 0; a flag error exits non-zero in one line)."""
    from bench import bench_cli

    results = bench_cli.run("", quick=True)
    for command, cases in results["commands"].items():
        assert cases["help"]["exit_codes"] == [0], (command, cases["help"])
        for name, case in cases.items():
            if name in ("help", "dpftrl_1e8_rounds"):
                continue
            assert 0 not in case["exit_codes"] and case["stderr_lines"] == [1], (command, case)
    assert results["commands"]["privacy"]["dpftrl_1e8_rounds"]["exit_codes"] == [0]
