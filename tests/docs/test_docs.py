"""README.md and docs/*.md say only true things about the code, checked without running a job.

* Every relative markdown link names a file that exists (and a heading of it, with ``#``).
* Every command of a shell block (a fence without a language) runs as pasted in a fresh
  shell: through the repository's virtual environment, never a bare ``python``.
* Every ``python SCRIPT`` / ``python -m nested...`` of those blocks and of inline spans (one
  quoted inside an ``ssh --command "..."`` and the one ``nested.launch`` starts after ``--``
  included) names an entry point that exists; every ``--flag`` it passes is one that entry
  point defines (its absl flags, or its argparse options); every config it names (``--config
  path.py:variant``, ``configs/x.py``, ``lm.py:variant``) loads; every ``--config.a.b=v``
  names a key of that config.
* Anywhere in a page, every ``--config.a.b`` names a key of ``tests/docs/config_keys.txt``; every
  flag named alone in a span (``--store``) is one of the page's entry points'; every path
  under ``nested/``, ``experiments/``, ``benchmarks/``, ``configs/`` or ``tests/`` exists; and
  every `` `nested.x.y` `` (``nl.x`` in a Python block) is a module or an attribute of one.

The entry points' flags are read in one subprocess (this file run as a script): each entry
point runs as ``__main__`` with ``absl.app.run`` and argparse's parsing replaced by a capture
of the flags defined so far, so no job starts; the flags one defines are removed before the
next runs (a flag a library defines on its first import counts for the first importer only:
the check errs toward refusing).
"""

import argparse
import contextlib
import functools
import importlib
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SEPARATORS = {"&&", "||", "|", ";"}
CONFIG_SPEC = re.compile(r"^(?:configs/)?(\w+\.py)(:[\w.-]+)?$")
REPO_PATH = re.compile(
    r"(?<![\w/.])((?:nested|experiments|benchmarks|configs|tests)/[\w/.-]*[\w/])"
)
DOTTED = re.compile(r"`(nested(?:\.\w+)+)")  # in prose: `nested.run.sharding`
CODE_NAME = re.compile(r"(?<![\w.])(?:nl|nested)((?:\.\w+)+)")  # in Python blocks: nl.generate
PROSE_FLAG = re.compile(r"(?<![\w-])--(?!config\.)([a-z]\w*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def shell_blocks(text: str) -> list[str]:
    """The page's fenced blocks without a language: shell commands (each fence paired with
    the next, so the text between a ```json block and the next block is not one)."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M)
    return [body for language, body in blocks if not language]


def dotted_names(text: str) -> set[str]:
    """``nested.a.b`` named in backticks, and ``nl.x`` / ``nested.x`` in Python blocks."""
    python = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return set(DOTTED.findall(text)) | {
        f"nested{name}" for block in python for name in CODE_NAME.findall(block)
    }


def spans(text: str) -> list[str]:
    """The page's inline code spans (outside fenced blocks)."""
    return re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def prose_flags(text: str) -> set[str]:
    """The ``--flag`` names (not ``--config.*``) of the page's inline spans that are flags
    (``--store``; not those of another program's command, ``gcloud ... --worker=all``)."""
    return {
        flag for span in spans(text) if span.startswith("--") for flag in PROSE_FLAG.findall(span)
    }


def span_command(span: str) -> list[str] | None:
    """The shell words of an inline span that runs an entry point (``python
    benchmarks/accelerator.py``, ``benchmarks/lm_throughput.py --profile``), else None."""
    words = shlex.split(span)
    if words and re.match(r"^(experiments|benchmarks)/\w+\.py$", words[0]):
        return ["python", *words]
    return words if words and words[0] == "python" else None


def command_lines(text: str) -> list[str]:
    """The non-blank lines of the page's shell blocks, backslash continuations joined."""
    joined = [block.replace("\\\n", " ") for block in shell_blocks(text)]
    return [line for block in joined for line in block.splitlines() if line.strip()]


def invocations(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """``(target, args)`` of every ``python SCRIPT args`` / ``python -m MODULE args`` in the
    shell words ``tokens``; a word holding a command line (``--command "..."``) is searched
    too, and ``-- SCRIPT args`` (a launcher's command) is one more."""
    found, i = [], 0
    while i < len(tokens):
        word = tokens[i]
        if " " in word:
            found += invocations(shlex.split(word))
        elif Path(word).name in ("python", "python3") and i + 1 < len(tokens):
            module = tokens[i + 1] == "-m"
            start = i + 3 if module else i + 2
            end = next((j for j in range(start, len(tokens)) if tokens[j] in SEPARATORS), None)
            end = len(tokens) if end is None else end
            args = tokens[start:end]
            if "--" in args:  # a launcher: what follows is the command it starts
                cut = args.index("--")
                args, launched = args[:cut], args[cut + 1 :]
                found.append((launched[0], launched[1:]))
            found.append((tokens[start - 1], args))
            i = end
            continue
        i += 1
    return [(target, args) for target, args in found if ours(target)]


def ours(target: str) -> bool:
    """A script of this repository or a module of nested (not ``venv``, ``pytest``, ``pip``)."""
    return target.endswith(".py") or target.split(".")[0] == "nested"


def config_spec(arg: str) -> str | None:
    """``configs/x.py[:variant]`` if the argument (or a flag's value) names a config file."""
    value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
    match = CONFIG_SPEC.match(value)
    return f"configs/{match[1]}{match[2] or ''}" if match else None


@functools.cache
def listing() -> frozenset[str]:
    """The keys of tests/docs/config_keys.txt as overrides name them, ``levels.*.`` for a level."""
    lines = (ROOT / "tests" / "docs" / "config_keys.txt").read_text().splitlines()
    names = (re.sub(r"\[[^\]]*\]", "", line.split()[0]) for line in lines)
    return frozenset(re.sub(r"^levels\.", "levels.*.", name) for name in names)


def registered(key: str) -> bool:
    """Whether ``section.key`` is in tests/docs/config_keys.txt, a level's name being any name."""
    return re.sub(r"^levels\.\w+\.", "levels.*.", key) in listing()


def slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_names_a_file_and_heading_that_exist():
    checked, broken = 0, []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{page.name}: {target} (no {file})")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no heading #{anchor})")
    assert checked > 20
    assert broken == []


def test_every_command_runs_as_pasted_in_a_fresh_shell():
    """Commands call the repository's virtual environment, never a bare ``python`` that a
    fresh shell (no venv activated) would not have the packages in."""
    commands = [line for page in PAGES for line in command_lines(page.read_text())]
    assert len(commands) > 20
    bare = [line for line in commands if re.match(r"\s*python\b(?!3 -m venv)", line)]
    assert bare == []


def test_every_path_and_config_key_the_pages_name_exists():
    texts = {page.name: page.read_text() for page in PAGES}
    missing = [
        f"{name}: {path}"
        for name, text in texts.items()
        for path in REPO_PATH.findall(text)
        if not (ROOT / path).exists()
    ]
    unknown = [
        f"{name}: --config.{key}"
        for name, text in texts.items()
        for key in re.findall(r"--config\.([\w.]+)", text)
        if not registered(key)
    ]
    assert missing == [] and unknown == []
    assert registered("levels.anyname.every") and not registered("model.dimm")


WRONG = ["experiments/nope.py", "nested.nope"]  # one of each kind, to see them refused


@pytest.fixture(scope="module")
def calls() -> list[tuple[str, str, list[str]]]:
    """``(page, target, args)`` of every invocation in the pages' shell blocks and spans."""
    found = []
    for page in PAGES:
        text = page.read_text()
        lines = [shlex.split(line, comments=True) for line in command_lines(text)]
        lines += list(filter(None, map(span_command, spans(text))))
        found += [
            (page.name, target, args) for words in lines for target, args in invocations(words)
        ]
    return found


@pytest.fixture(scope="module")
def facts(calls) -> dict:
    """The entry points' options, the configs' keys and the dotted names' resolution, read in
    one subprocess (:func:`main`), for the pages and for :data:`WRONG`."""
    targets = sorted({target for _, target, _ in calls} | {WRONG[0]})
    specs = sorted({spec for *_, args in calls for spec in map(config_spec, args) if spec})
    names = sorted({name for page in PAGES for name in dotted_names(page.read_text())})
    return read_facts(targets, specs, [*names, WRONG[1]])


def test_every_command_names_a_real_entry_point_flag_config_and_key(calls, facts):
    dotted = [name for name in facts["names"] if name != WRONG[1]]
    assert len(calls) > 20 and len(facts["configs"]) > 10 and len(dotted) > 10
    wrong = [f"`{name}`: {facts['names'][name]}" for name in dotted if facts["names"][name]]
    for page, target, args in calls:
        entry, where = facts["targets"][target], f"{page}: {target}"
        if "error" in entry:
            wrong.append(f"{where}: {entry['error']}")
            continue
        spec = next(filter(None, map(config_spec, args)), None)
        config = facts["configs"][spec] if spec else None
        if config and config["error"]:
            wrong.append(f"{where}: config {spec}: {config['error']}")
            config = None  # its overrides are checked against the listing only
        wrong += [
            f"{where}: {arg} is not a flag or key it takes"
            for arg in args
            if not takes(entry, config, arg)
        ]
    assert wrong == []


def test_every_flag_the_prose_names_is_one_of_its_commands_entry_points(calls, facts):
    """``--store`` in the companion's text is a flag of a command that page shows."""
    named, wrong = 0, []
    for page in PAGES:
        options = {
            option.lstrip("-")
            for name, target, _ in calls
            if name == page.name
            for option in facts["targets"][target].get("options", [])
        }
        flags = prose_flags(page.read_text())
        named += len(flags)
        wrong += [f"{page.name}: --{flag}" for flag in sorted(flags - options)]
    assert named > 10
    assert wrong == []


def takes(entry: dict, config: dict | None, arg: str) -> bool:
    """Whether the entry point (``{"parser", "options"}``) accepts the argument ``arg``: a
    value, a flag it defines, or (absl) ``--config.<key>`` of a registered key that ``config``
    (the invocation's config's facts, if it names one) holds."""
    if not arg.startswith("-") or re.match(r"^-\d", arg):
        return True
    name = arg.split("=", 1)[0]
    if entry["parser"] == "argparse":
        return name in entry["options"]
    if name.startswith("--config."):
        key = name[len("--config.") :]
        return registered(key) and (config is None or key in config["keys"])
    flag = name[2:]
    return flag in entry["options"] or (flag.startswith("no") and flag[2:] in entry["options"])


def test_the_checks_refuse_a_wrong_flag_key_entry_point_and_name(facts):
    """The parsing the checks rest on: one wrong name of each kind is seen."""
    line = (
        'ssh host --command "cd x && .venv/bin/python experiments/train.py --config '
        'configs/mqar.py:hope --config.model.dimm=3" && .venv/bin/python -m nested.launch '
        "--num_processes 2 -- experiments/nope.py --workdir w  # a comment"
    )
    train_args = ["--config", "configs/mqar.py:hope", "--config.model.dimm=3"]
    assert invocations(shlex.split(line, comments=True)) == [
        ("experiments/train.py", train_args),
        ("experiments/nope.py", ["--workdir", "w"]),
        ("nested.launch", ["--num_processes", "2"]),
    ]
    assert config_spec("lm.py:hope-tiny") == "configs/lm.py:hope-tiny"
    assert config_spec("--config=configs/mqar.py") == "configs/mqar.py"
    assert config_spec("runs/mqar") is None
    assert "No such file" in facts["targets"][WRONG[0]]["error"]
    assert facts["names"][WRONG[1]] == "nested has no 'nope'"
    train = facts["targets"]["experiments/train.py"]
    mqar = facts["configs"]["configs/mqar.py"]
    assert train["parser"] == "absl" and takes(train, mqar, "--workdir=runs/x")
    assert takes(train, mqar, "--config.levels.memory.every=16")
    assert not takes(train, mqar, "--config.levels.nope.every=16")  # no level 'nope' in it
    assert not takes(train, None, "--config.model.dimm=3") and not takes(train, None, "--bogus")
    pod = facts["targets"]["benchmarks/pod_memory.py"]
    assert (
        pod["parser"] == "argparse"
        and takes(pod, None, "--mesh")
        and not takes(pod, None, "--meshes")
    )


def read_facts(targets: list[str], specs: list[str], names: list[str]) -> dict:
    """What the subprocess :func:`main` reports (its last line of stdout, JSON)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, __file__, json.dumps([targets, specs, names])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


class Captured(Exception):
    """Raised where an entry point would parse its command line: ``options`` it defines."""

    def __init__(self, parser: str, options: list[str]):
        super().__init__(parser)
        self.parser, self.options = parser, options


def entry_point_options(target: str) -> dict:
    """``{"parser", "options"}`` of the script or module ``target`` (run as ``__main__`` up to
    where it parses its flags), or ``{"error"}``."""
    from absl import flags

    before = set(flags.FLAGS)
    folder = str(ROOT / Path(target).parent)
    sys.path.insert(0, folder)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: module already imported
            if target.endswith(".py"):
                runpy.run_path(str(ROOT / target), run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        return {"error": "it ran to the end without parsing its flags"}
    except Captured as captured:
        return {"parser": captured.parser, "options": captured.options}
    except BaseException as error:  # noqa: BLE001 - reported as the target's error
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        sys.path.remove(folder)
        for name in set(flags.FLAGS) - before:
            delattr(flags.FLAGS, name)


def config_facts(spec: str) -> dict:
    """``{"error", "keys"}``: whether ``get_config`` of ``spec`` runs, and its dotted keys."""
    from ml_collections import config_dict

    from nested.run import config as nc

    def keys(node, prefix=""):
        for key, value in node.items():
            yield prefix + key
            if isinstance(value, config_dict.ConfigDict):
                yield from keys(value, f"{prefix}{key}.")

    try:
        return {"error": None, "keys": sorted(keys(nc.load(str(ROOT / spec))))}
    except Exception as error:  # noqa: BLE001 - reported as the config's error
        return {"error": f"{type(error).__name__}: {error}", "keys": []}


def resolve(name: str, ran: set[str]) -> str | None:
    """None if ``nested.a.b.c`` is a module or an attribute of one, else why not. A module of
    ``ran`` (run as ``__main__`` already) is not imported again: it may register itself in a
    registry on import (``nested.run.harness``), which refuses a second class of the name."""
    if any(name == module or name.startswith(f"{module}.") for module in ran):
        return None
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        with contextlib.suppress(ImportError):
            node = importlib.import_module(".".join(parts[:cut]))
            break
    else:
        return "no module"
    for part in parts[cut:]:
        if not hasattr(node, part):
            return f"{node.__name__} has no {part!r}"
        node = getattr(node, part)
    return None


def main(targets: list[str], specs: list[str], names: list[str]) -> dict:
    from absl import app, flags

    def absl_run(*args, **kwargs):
        raise Captured("absl", sorted(flags.FLAGS))

    def argparse_parse(parser, *args, **kwargs):
        """The parser's options and its subcommands' (``lm_eval run --model ...``)."""
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        commands = [command for action in subparsers for command in action.choices.values()]
        options = {o for p in (parser, *commands) for o in p._option_string_actions}
        raise Captured("argparse", sorted(options))

    app.run, argparse.ArgumentParser.parse_known_args = absl_run, argparse_parse
    argv = sys.argv
    result = {"targets": {}, "configs": {}, "names": {}}
    for target in targets:
        sys.argv = [target]
        result["targets"][target] = entry_point_options(target)
    sys.argv = argv
    result["configs"] = {spec: config_facts(spec) for spec in specs}
    ran = {target for target in targets if not target.endswith(".py")}
    result["names"] = {name: resolve(name, ran) for name in names}
    return result


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        facts = main(*json.loads(sys.argv[1]))
    print(json.dumps(facts))
