"""The user documentation agrees with itself and with the code, where a machine can tell.

Pure file parsing plus a few cheap calls into the code (the export decision, the placement line):
- every relative link and `#anchor` of README.md, CONTRIBUTING.md, docs/*.md and benchmarks/README.md
  resolves (GitHub's heading slugs);
- every test file and test function the documentation cites exists in tests/;
- the table of exported Hugging Face classes in docs/conversion.md (the one home of that rule) is
  what mixln_megatron/hf/export_code.py decides, row by row;
- every build line `[mixln_megatron] scheme=...` quoted in the documentation is what the code prints
  for those settings;
- a version of transformers, Megatron-Bridge, TransformerEngine or megatron-core stated in the
  documentation is the one its source pins (setup.py, scripts/install_*.sh, scripts/compat_env.sh);
- user pages carry no dates (YYYY-MM-DD): measured figures and their dates live in
  benchmarks/README.md.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
BENCHMARKS = ROOT / "benchmarks" / "README.md"
HF_CONVERSION = ROOT / "docs" / "conversion.md"
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.M | re.S)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def rel_or_name(path: Path) -> str:
    return rel(path) if path.is_relative_to(ROOT) else path.name


def ids(paths):
    return [rel(p) for p in paths]


@functools.lru_cache(maxsize=None)
def prose(path: Path) -> str:
    """The page without its fenced code blocks (a `# comment` in a shell block is no heading)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------ links and anchors
def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than `-` and `_`
    removed, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).lower()  # inline HTML tags
    text = re.sub(r"[^\w\- ]", "", text)  # `code`, *emphasis*, punctuation
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset:
    """Every anchor of a page: its headings' slugs (a repeated one numbered -1, -2, as GitHub does) and
    any `<a name=...>` / `id=...`."""
    seen, found = {}, set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", prose(path), re.M):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    found |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", prose(path)))
    return frozenset(found)


def links(path: Path) -> list:
    """(target, anchor) of every inline Markdown link outside code."""
    text = re.sub(r"`[^`\n]*`", "", prose(path))
    found = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        found.append((file, anchor))
    return found


def broken_links(path: Path) -> list:
    broken = []
    for file, anchor in links(path):
        target = (path.parent / file).resolve() if file else path
        if not target.exists():
            broken.append(f"{file}{'#' + anchor if anchor else ''} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{file}#{anchor} (no such heading in {rel_or_name(target)})")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_links_and_anchors_resolve(doc):
    """A renamed page or heading fails here, not in a reader's browser."""
    broken = broken_links(doc)
    assert not broken, f"{rel(doc)}: broken links {broken}"


def test_the_anchor_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Checkpoint vetting (`vetting.py`)\n\n```bash\n# not a heading\n```\n\n"
                    "[a](#checkpoint-vetting-vettingpy) [b](#checkpoint-vetting) [c](#not-a-heading) "
                    "[d](missing.md) [e](page.md#title)\n")
    assert broken_links(page) == ["#checkpoint-vetting (no such heading in page.md)",
                                  "#not-a-heading (no such heading in page.md)", "missing.md (no such file)"]
    assert github_slug("At scale: optimizer instances and CUDA graphs") == "at-scale-optimizer-instances-and-cuda-graphs"
    assert github_slug("Initialisation, telemetry and Bridge checks (2-core machine)") == \
        "initialisation-telemetry-and-bridge-checks-2-core-machine"


# ------------------------------------------------------------------------------------ cited tests
TEST_FILE = re.compile(r"(?<![\w/.-])(?:tests/)?(test_[\w*]+\.py)((?:::[\w*\[\]-]+)?)")
LATER_FUNCTION = re.compile(r"(?<![\w.])::(test_[\w*]+)")


def cited_tests(text: str) -> list:
    """(file pattern, function pattern or None) of every test a text names: `tests/test_x.py`,
    `test_x.py::test_y`, and a `::test_z` after a file on the same line (the same file)."""
    found = []
    for line in text.splitlines():
        last = None
        for match in re.finditer(rf"{TEST_FILE.pattern}|{LATER_FUNCTION.pattern}", line):
            if match.group(1):
                last = match.group(1)
                function = match.group(2)[2:].split("[")[0] or None
                found.append((last, function))
            elif last:
                found.append((last, match.group(3)))
    return found


def missing_tests(citations) -> list:
    files = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    missing = []
    for file_pattern, function in citations:
        matched = fnmatch.filter(files, file_pattern)
        if not matched:
            missing.append(file_pattern)
            continue
        if function is None:
            continue
        defined = {name for f in matched
                   for name in re.findall(r"^\s*(?:async\s+)?def\s+(test_\w+)", (ROOT / "tests" / f).read_text(), re.M)}
        if not fnmatch.filter(defined, function):
            missing.append(f"{file_pattern}::{function}")
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_cited_tests_exist(doc):
    """A test the documentation points to as evidence exists under that name."""
    missing = missing_tests(cited_tests(doc.read_text(encoding="utf-8")))
    assert not missing, f"{rel(doc)} cites tests that do not exist in tests/: {missing}"


def test_the_cited_test_check_can_fail():
    text = "`test_untrusted_checkpoints.py::test_to_hf_refuses_payload`, `::test_vetting_*`; tests/test_nope.py"
    assert cited_tests(text) == [("test_untrusted_checkpoints.py", "test_to_hf_refuses_payload"),
                                 ("test_untrusted_checkpoints.py", "test_vetting_*"), ("test_nope.py", None)]
    assert missing_tests(cited_tests(text)) == ["test_untrusted_checkpoints.py::test_vetting_*", "test_nope.py"]


# ------------------------------------------------------------------------------------ exported classes
TABLE_BEGIN, TABLE_END = "<!-- export-classes:begin", "<!-- export-classes:end -->"
SHAPE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
NUM_LAYERS = 4
# Megatron-LM flags a row may name -> the export decision's keyword arguments. A flag not here fails the
# test: add what the converter passes for it (mixln_megatron/convert/to_hf.py, moe_config_fields).
MOE_FLAGS = {
    "--num-experts": lambda v: {"num_experts": int(v)},
    "--moe-shared-expert-intermediate-size": lambda v: {"shared_expert_intermediate_size": int(v)},
    "--moe-shared-expert-gate": lambda v: {"shared_expert_gate": True},
    "--moe-layer-freq": lambda v: {"mlp_only_layers": [i for i, x in enumerate(eval(v, {})) if not x]},  # noqa: S307
    "--moe-router-pre-softmax": lambda v: {"norm_topk_prob": False},
    "--add-qkv-bias": lambda v: {"qkv_bias": True},
    "--moe-router-dtype": lambda v: {"router_dtype": {"fp32": "float32", "fp64": "float64"}[v]},
    "--dtype": lambda v: {"dtype": v},  # to-hf's export dtype, as the converter passes it
}
TAKES_VALUE = {"--num-experts", "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--moe-router-dtype", "--dtype",
               "--mixln-alpha", "--mixln-post-ln-layers", "--mixln-layout", "--mixln-scheme"}


def table_rows(text: str) -> list:
    """The cells of each body row of the marked table."""
    start = text.index(TABLE_BEGIN)
    body = text[start:text.index(TABLE_END, start)].splitlines()[1:]
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] for line in body if line.startswith("|")]
    return rows[2:]  # header and rule


def flag_values(cell: str) -> dict:
    words = shlex.split(" ".join(re.findall(r"`([^`]*)`", cell)))
    out, i = {}, 0
    while i < len(words):
        flag = words[i]
        assert flag.startswith("--"), f"{cell!r}: expected a flag, got {flag!r}"
        if flag in TAKES_VALUE:
            out[flag], i = words[i + 1], i + 2
        else:
            out[flag], i = None, i + 1
    return out


def exported_class(settings_cell: str, moe_cell: str) -> tuple:
    """(class name, remote code?) the export code gives a model of these flags, or ("refused", None)."""
    from mixln_megatron.hf.export_code import export_config_fields, moe_export_config_fields, placement_export_fields
    from mixln_megatron.model.placement import resolve_placement
    from mixln_megatron.model.settings import MixLNSettings

    settings = {flag[len("--mixln-"):].replace("-", "_"): value for flag, value in flag_values(settings_cell).items()}
    if "post_ln_layers" in settings:
        settings["post_ln_layers"] = int(settings["post_ln_layers"])
    fields = placement_export_fields(resolve_placement(NUM_LAYERS, MixLNSettings(**settings)))
    moe_flags = flag_values(moe_cell)
    try:
        if not moe_flags:
            out = export_config_fields(**fields)
        else:
            kwargs = dict(SHAPE)
            for flag, value in moe_flags.items():
                assert flag in MOE_FLAGS, f"{flag}: tests/test_doc_consistency.py does not know what the export gets for it"
                kwargs.update(MOE_FLAGS[flag](value))
            out = moe_export_config_fields(**fields, **kwargs, num_hidden_layers=NUM_LAYERS)
    except ValueError:
        return "refused", None
    return out["architectures"][0], "auto_map" in out


def test_the_export_class_table_is_the_export_decision():
    """docs/conversion.md's table of exported classes: each row's class and remote-code column are
    what the export code decides for that row's flags (a row per case of the rule)."""
    rows = table_rows(HF_CONVERSION.read_text(encoding="utf-8"))
    assert len(rows) >= 8, "the export-class table has too few rows"
    wrong = []
    for model, settings, moe, cls, remote in rows:
        documented = re.sub(r"[`*]", "", cls).split()[0]
        got, needs_code = exported_class(settings, moe)
        documented_code = None if documented == "refused" else remote.lower().startswith("yes")
        if (documented, documented_code) != (got, needs_code):
            wrong.append(f"{model} {settings} {moe}: the doc says {documented} (remote code {remote!r}), "
                         f"the export gives {got} (remote code {needs_code})")
    assert not wrong, "docs/conversion.md's export-class table disagrees with the code:\n" + "\n".join(wrong)


def test_the_export_class_check_can_fail():
    assert exported_class("`--mixln-layout sandwich:*`", "") == ("MixLNLlamaForCausalLM", True)  # P = 0, not stock
    assert exported_class("`--mixln-post-ln-layers 0`", "") == ("LlamaForCausalLM", False)
    assert exported_class("`--mixln-post-ln-layers 0`", "`--num-experts 4 --moe-layer-freq [0,1,1,1]`")[0] != \
        "MixtralForCausalLM"


# ------------------------------------------------------------------------------------ build lines
BUILD_LINE = re.compile(r"\[mixln_megatron\] scheme=[^`\n]*")


def expected_build_line(quoted: str) -> str:
    """What the code prints for the settings a quoted build line names (its source included)."""
    from mixln_megatron.model.placement import resolve_placement
    from mixln_megatron.model.settings import MixLNSettings

    num_layers = int(re.search(r"\bL=(\d+)", quoted).group(1))
    source = re.search(r"\((?:from )?([^()]*?)\)(?=;|$)", quoted.split(";")[0])
    values = {}
    if m := re.search(r"\blayout=(\S+)", quoted):
        values["layout"] = m.group(1)
    elif (m := re.search(r"\balpha=([\d.]+)", quoted)) and not (source and source.group(1) == "default"):
        values["alpha"] = m.group(1)
    elif m := re.search(r"\bP=(\d+)", quoted):
        values["post_ln_layers"] = int(m.group(1))
    if (m := re.search(r"scheme=(\S+)", quoted)) and m.group(1) != "mixln":
        values["scheme"] = m.group(1)
    where = source.group(1) if source else "default"
    if where.startswith("MIXLN_"):
        settings = MixLNSettings.from_environ(
            environ={"MIXLN_" + k.upper(): str(v) for k, v in values.items()})
    elif where.startswith("--mixln-"):
        settings = MixLNSettings(**values, sources={k: "--mixln-" + k.replace("_", "-") for k in values})
    else:
        settings = MixLNSettings(**values)
    return resolve_placement(num_layers, settings).describe()


def quoted_build_lines(text: str) -> list:
    lines = [m.group(0).rstrip(" `") for m in BUILD_LINE.finditer(text)]
    return [line if line.endswith("...") else line.rstrip(".") for line in lines]


def build_line_disagrees(quoted: str):
    """None, or what the code prints instead (a quote may end in `...`: then the prefix must match)."""
    if "L=" not in quoted:
        return None  # `[mixln_megatron] scheme=...`: the line's name, not an example
    real = expected_build_line(quoted)
    prefix = quoted.split("...")[0].rstrip() if "..." in quoted else None
    return None if (real.startswith(prefix) if prefix else real == quoted) else real


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_quoted_build_lines_are_what_the_code_prints(doc):
    wrong = [(q, real) for q in quoted_build_lines(doc.read_text(encoding="utf-8"))
             if (real := build_line_disagrees(q)) is not None]
    assert not wrong, f"{rel(doc)}: quoted build lines differ from the code's: " + "; ".join(
        f"\n  doc:  {q}\n  code: {r}" for q, r in wrong)


def test_the_build_line_check_can_fail():
    bad = ("[mixln_megatron] scheme=mixln L=24 layout=deepnorm:1-6,pre:7-24 (from MIXLN_LAYOUT); "
           "Post/Pre boundaries: 6|7; deepnorm alpha=2.63215 beta=0.180648")
    assert build_line_disagrees(bad) is not None
    good = "[mixln_megatron] scheme=mixln L=32 P=2 alpha=0.0625 (from MIXLN_ALPHA); Post-LN layers: 1, 2"
    assert build_line_disagrees(good) is None
    assert build_line_disagrees("[mixln_megatron] scheme=mixln L=32 P=2 ...") is None
    assert build_line_disagrees("[mixln_megatron] scheme=mixln L=32 P=3 alpha=0.0625 ...") is not None


# ------------------------------------------------------------------------------------ version pins
def _read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def pinned_versions() -> dict:
    """package -> {version or range -> its source}, read from the files that pin them."""
    setup = _read("setup.py")

    def spec(package):
        return re.search(rf'"{re.escape(package)}\s*([<>=!~][^"]*)"', setup).group(1).replace(" ", "")

    te = re.search(r"^TE_VERSION=(\S+)", _read("scripts/install_te.sh"), re.M).group(1)
    bridge_transformers = re.search(r"^transformers==(\S+)", _read("scripts/install_bridge.sh"), re.M).group(1)
    compat = re.findall(r"pin=([\d.]+)", _read("scripts/compat_env.sh"))
    wheels = re.findall(r"^megatron_core-([\d.]+)-", "\n".join(p.name for p in (ROOT / "benchmarks" / "wheels").iterdir()), re.M)
    return {
        "transformers": {spec("transformers"): "setup.py (extra hf)", bridge_transformers: "scripts/install_bridge.sh"},
        "megatron-bridge": {spec("megatron-bridge").lstrip("="): "setup.py (extra bridge)"},
        "transformerengine": {te: "scripts/install_te.sh"},
        "megatron-core": {spec("megatron-core"): "setup.py", **{v: "scripts/compat_env.sh" for v in compat},
                          **{v: "benchmarks/wheels" for v in wheels}},
    }


PACKAGE = {"transformers": "transformers", "megatron-bridge": "megatron-bridge", "bridge": "megatron-bridge",
           "transformerengine": "transformerengine", "te": "transformerengine", "megatron-core": "megatron-core"}
VERSION_MENTION = re.compile(
    r"(?i)(?<![\w-])(transformers|megatron-bridge|bridge|transformerengine|te|megatron-core)"
    r"(?:'s)?[ \t]+(?:releases?:?[ \t]+)?"
    r"((?:[<>=]=?[ \t]*\d+(?:\.\d+)*(?:[ \t]*,[ \t]*[<>]=?[ \t]*\d+(?:\.\d+)*)?)|\d+\.\d+(?:\.\d+)?(?=[^\w.]|$))")
# A version no source pins, stated for a reason the test can check: (package, version) -> (file, text in it).
STATED_ELSEWHERE = {
    ("transformers", ">=5"): ("mixln_megatron/hf/configuration_mixln_moe.py", "Written for transformers >= 5"),
    ("megatron-core", "0.21.0"): ("mixln_megatron/compat.py", "FIRST_UNSUPPORTED = (0, 17), (0, 21)"),  # the refusal's example
}


MORE_VERSIONS = re.compile(r"(?:[ \t]*\([^()\n]*\))?(?:[ \t]*,[ \t]*(?:and[ \t]+)?|[ \t]+(?:and|or)[ \t]+)"
                           r"(\d+\.\d+(?:\.\d+)?)(?=[^\w.]|$)")


def version_mentions(text: str) -> list:
    """(package, version as written) of each `<package> <version>` in a text, and of the versions
    listed after it (`transformers 5.12.1 (Bridge's pin) and 5.24`)."""
    found = []
    for m in VERSION_MENTION.finditer(text):
        package = PACKAGE[m.group(1).lower()]
        found.append((package, m.group(2).replace(" ", "").replace("\t", "")))
        end = m.end()
        while more := MORE_VERSIONS.match(text, end):
            found.append((package, more.group(1)))
            end = more.end()
    return found


def unpinned(mentions) -> list:
    pins = pinned_versions()
    bad = []
    for package, version in mentions:
        if re.fullmatch(r"\d+\.\d+", version) and any(pin.startswith(version + ".") for pin in pins[package]):
            continue  # a release line (megatron-core 0.19, TE 2.20) of a pinned release
        if (package, version) in STATED_ELSEWHERE:
            path, text = STATED_ELSEWHERE[package, version]
            if text in _read(path):
                continue
        if version not in pins[package]:
            bad.append(f"{package} {version} (pinned: {', '.join(f'{v} in {s}' for v, s in pins[package].items())})")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_stated_versions_are_the_pinned_ones(doc):
    """A version the documentation states is the one its source pins: one source, no drift."""
    text = doc.read_text(encoding="utf-8")
    if doc == BENCHMARKS:  # a measurement names what it ran on: its date says when
        return
    bad = unpinned(version_mentions(text))
    assert not bad, f"{rel(doc)} states versions no source pins: {bad}"


def test_one_supported_megatron_core_range():
    """setup.py's requirement and the import-time check (compat.SUPPORTED) are one range."""
    assert re.search(r'^SUPPORTED = "([^"]+)"', _read("mixln_megatron/compat.py"), re.M).group(1) == \
        next(v for v, s in pinned_versions()["megatron-core"].items() if s == "setup.py")


def test_the_version_check_can_fail():
    mentions = version_mentions("Tested transformers releases: 5.24, and 5.12.1; megatron-core >=0.17,<0.21; "
                                "Megatron-Bridge 0.6.2; TE 2.20.2; megatron-core 0.19; "
                                "transformers 5.12.1 (Bridge's pin) and 5.25 (ours)")
    assert mentions == [("transformers", "5.24"), ("transformers", "5.12.1"), ("megatron-core", ">=0.17,<0.21"),
                        ("megatron-bridge", "0.6.2"), ("transformerengine", "2.20.2"), ("megatron-core", "0.19"),
                        ("transformers", "5.12.1"), ("transformers", "5.25")]
    assert [m.split(" (")[0] for m in unpinned(mentions)] == ["transformers 5.24", "transformers 5.25"]


# ------------------------------------------------------------------------------------ dates
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# (page, date) -> why a user page may carry it
DATE_ALLOWED: dict = {}


@pytest.mark.parametrize("doc", [d for d in DOCS if d != BENCHMARKS], ids=ids([d for d in DOCS if d != BENCHMARKS]))
def test_no_dates_outside_the_benchmarks(doc):
    """Measured figures, with their dates, live in benchmarks/README.md; user pages link there."""
    dated = [d for d in DATE.findall(doc.read_text(encoding="utf-8")) if (rel(doc), d) not in DATE_ALLOWED]
    assert not dated, f"{rel(doc)} carries dates {dated}: move the dated figure to benchmarks/README.md and link it"


def test_the_date_check_can_fail():
    assert DATE.findall("peaked at 799 MB RSS (2026-12-03, shared 2-core CPU machine)") == ["2026-12-03"]


# ------------------------------------------------------------------------------------ the unsupported list
SUPPORT_HOME = ROOT / "docs" / "compatibility.md"


def undocumented_refusals(text: str) -> list:
    """Rows of the support table (model/support.py) that refuse at build or training time and that the
    text names by neither a flag of the row nor a field name."""
    from mixln_megatron.model import support

    training = {support.LAYER, support.PRETRAIN, getattr(support, "STOCK", support.PRETRAIN)}
    rows = [r for r in support.TABLE if r.where & training] + list(support.DEEPNORM_INIT_TABLE)
    missing = []
    for row in rows:
        names = set(row.names) | set(re.findall(r"--[\w-]+", row.what))
        if not any(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) for name in names):
            missing.append(row.what)
    return missing


def test_the_unsupported_list_is_the_support_table():
    """docs/compatibility.md is the one page listing what Mix-LN refuses; it names every row."""
    section = SUPPORT_HOME.read_text(encoding="utf-8").split("## What is supported", 1)[1].split("\n## ", 1)[0]
    missing = undocumented_refusals(section)
    assert not missing, f"{rel(SUPPORT_HOME)} (What is supported) does not name these refusals of " \
                        f"mixln_megatron/model/support.py: {missing}"


def test_the_unsupported_list_check_can_fail():
    assert "Megatron-FSDP (--use-megatron-fsdp)" in undocumented_refusals("multi-latent attention, `--use-kitchen`")


# ------------------------------------------------------------------------------------ repository paths
REPO_PATH = re.compile(r"`((?:examples|benchmarks|scripts|tests|patches|docs|mixln_megatron|\.ci)/[\w./-]*)`")


def missing_paths(text: str, base: Path = ROOT) -> list:
    """Repository paths named in `code` that do not exist (a glob must match something)."""
    missing = []
    for path in REPO_PATH.findall(text):
        path = path.rstrip("/")
        if not (list(base.glob(path)) if "*" in path else (base / path).exists()):
            missing.append(path)
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_named_repository_paths_exist(doc):
    missing = missing_paths(doc.read_text(encoding="utf-8"))
    assert not missing, f"{rel(doc)} names repository paths that do not exist: {missing}"


def test_the_path_check_can_fail():
    assert missing_paths("`benchmarks/hf_parity.py`, `tests/test_moe_*.py`, `scripts/nope.sh`") == ["scripts/nope.sh"]


# ------------------------------------------------------------------------------------ project bookkeeping
BOOKKEEPING = re.compile(r"(?i)\b(?:issue|session|pull request|PR|ticket)\s*#?\d+\b|\bcommit\s+[0-9a-f]{7,40}\b")


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_no_issue_session_or_commit_numbers(doc):
    """User docs describe the software, not the project's history."""
    found = BOOKKEEPING.findall(doc.read_text(encoding="utf-8"))
    assert not found, f"{rel(doc)} refers to project bookkeeping: {found}"


def test_the_bookkeeping_check_can_fail():
    assert BOOKKEEPING.findall("fixed in issue 43 (session 12, commit cdc2e28)") == ["issue 43", "session 12",
                                                                                   "commit cdc2e28"]


# ------------------------------------------------------------------------------------ Python names
PACKAGE_DIR = ROOT / "mixln_megatron"
DOTTED = re.compile(r"`(mixln_megatron(?:\.[A-Za-z_]\w*)*)[(`]")
PY_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.M | re.S)


@functools.lru_cache(maxsize=None)
def module_file(dotted: str):
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=None)
def module_tree(path: Path):
    import ast

    return ast.parse(path.read_text(encoding="utf-8"))


def defined_in(path: Path, name: str):
    """The AST node that defines `name` at the top level of a module file, True when the module names
    it as a string (`__all__`, a lazy-export table), else None. Read, not imported: no optional
    package (Megatron-Bridge, TE) is needed."""
    import ast

    for node in module_tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name for a in node.names):
            return node
    return True if re.search(rf"['\"]{re.escape(name)}['\"]", path.read_text(encoding="utf-8")) else None


def unresolved(dotted: str):
    """None when `mixln_megatron.a.b.name` names a module or a top-level name of one, else the reason."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:i]))
        if path is None:
            continue
        rest = parts[i:]
        if not rest:
            return None
        return None if defined_in(path, rest[0]) is not None else f"{'.'.join(parts[:i])} defines no {rest[0]}"
    return "no such module"


def keyword_problems(source: str) -> list:
    """Calls in a Python example of functions / classes imported from mixln_megatron with keywords the
    definition does not take."""
    import ast

    tree = ast.parse(source)
    origin = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mixln_megatron"):
            for alias in node.names:
                origin[alias.asname or alias.name] = (node.module, alias.name)
    problems = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in origin):
            continue
        module, name = origin[node.func.id]
        path = module_file(module)
        definition, path = followed(path, name) if path else (None, None)
        if definition is None:
            problems.append(f"{module} has no {name}")
            continue
        accepted = parameters(definition, path)
        if accepted is None:
            continue
        problems += [f"{name}() takes no keyword {k.arg!r}" for k in node.keywords if k.arg and k.arg not in accepted]
    return problems


def followed(path: Path, name: str, depth: int = 0):
    """(node, file) of defined_in, through re-exports (`from .spec import x` in a package's __init__)."""
    import ast

    node = defined_in(path, name)
    if isinstance(node, ast.ImportFrom) and depth < 5:
        package = path.parent.relative_to(ROOT).as_posix().replace("/", ".")
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        module = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
        alias = next(a for a in node.names if (a.asname or a.name) == name)
        target = module_file(module) if module and module.startswith("mixln_megatron") else None
        if target is not None:
            found, where = followed(target, alias.name, depth + 1)
            return (node, path) if found is None else (found, where)
    return node, path


def parameters(definition, path: Path = None):
    """Keyword names a def or a (data)class accepts; None when unknown (**kwargs, re-exports)."""
    import ast

    if isinstance(definition, ast.ClassDef):
        init = next((n for n in definition.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is not None:
            return parameters(init, path)
        fields = {n.target.id for n in definition.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        for base in definition.bases:  # a dataclass's inherited fields, from bases of the same module
            if isinstance(base, ast.Name) and base.id == "object":
                continue
            inherited = parameters(defined_in(path, base.id), path) if path and isinstance(base, ast.Name) else None
            if inherited is None:
                return None
            fields |= inherited
        return fields
    if isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = definition.args
        if args.kwarg is not None:
            return None
        return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    return None


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_python_names_in_the_docs_exist(doc):
    """Every `mixln_megatron.x.y` a page names, and every name and keyword its Python examples import
    from mixln_megatron and call, exists (read from the source files, nothing imported)."""
    text = doc.read_text(encoding="utf-8")
    problems = [f"{d}: {why}" for d in sorted(set(DOTTED.findall(text))) if (why := unresolved(d))]
    for block in PY_FENCE.findall(text):
        problems += keyword_problems(block)
        problems += [f"{m}: {why}" for m in re.findall(r"^\s*(?:from|import)\s+(mixln_megatron[\w.]*)", block, re.M)
                     if (why := unresolved(m))]
    assert not problems, f"{rel(doc)} names Python objects that do not exist: {problems}"


def test_the_python_name_check_can_fail():
    assert unresolved("mixln_megatron.training.spike.install_spike_scaler") is None
    assert unresolved("mixln_megatron.training.spike.install_spike_scalar") is not None
    assert unresolved("mixln_megatron.nope") == "mixln_megatron defines no nope"
    assert keyword_problems("from mixln_megatron.model.placement import resolve_placement\n"
                            "resolve_placement(4, setting=None)\n") == ["resolve_placement() takes no keyword 'setting'"]


@functools.lru_cache(maxsize=None)
def package_definitions() -> dict:
    """name -> [(node, file)] of every top-level def and class in mixln_megatron (hf/ excepted: the
    exported model code), read with ast."""
    import ast

    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in module_tree(path).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.setdefault(node.name, []).append((node, path))
    return found


INLINE_CALL = re.compile(r"`((?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)\((?:[^`()]|\([^`()]*\))*\))`")


def inline_call_problems(text: str) -> list:
    """Inline-code calls of a function or class the package defines once (`install_training_hooks(config,
    settings, hybrid=True)`, `mixln_megatron.bridge.use_local_backend(provider, cpu=True)`) with keywords
    the definition does not take."""
    import ast

    problems = []
    for call, name in INLINE_CALL.findall(prose_of(text)):
        definitions = package_definitions().get(name, [])
        if len(definitions) != 1:
            continue
        try:
            node = ast.parse(call.replace("...", "None"), mode="eval").body
        except SyntaxError:
            continue
        accepted = parameters(*definitions[0])
        if accepted is not None and isinstance(node, ast.Call):
            problems += [f"`{call}`: {name}() takes no keyword {k.arg!r}" for k in node.keywords
                         if k.arg and k.arg not in accepted]
    return problems


def prose_of(text: str) -> str:
    return FENCE.sub("", text)


@pytest.mark.parametrize("doc", DOCS, ids=ids(DOCS))
def test_inline_calls_take_those_keywords(doc):
    problems = inline_call_problems(doc.read_text(encoding="utf-8"))
    assert not problems, f"{rel(doc)}: {problems}"


def test_the_inline_call_check_can_fail():
    assert keyword_problems("from mixln_megatron import MixLNSettings\nMixLNSettings(alpa=1)\n") == \
        ["MixLNSettings() takes no keyword 'alpa'"]
    assert inline_call_problems("`resolve_placement(4, setting=None)` and `resolve_placement(4, settings=None)`") == \
        ["`resolve_placement(4, setting=None)`: resolve_placement() takes no keyword 'setting'"]
