"""benchmarks/results/ keeps the newest result per benchmark, variant and CPU class; earlier
runs live in git's history. A file is named ``<benchmark>[_<variant>...][_<cpu>].json``: the
benchmark is a script's name, each variant a word of VARIANTS, the CPU one of CPU_CLASSES. A
name carrying a commit, a clock time or "before" is a one-off run, which belongs in history.
The results' README lists exactly the files kept, and every results file the docs name either
exists or is marked "(in git history)"."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS = sorted((p.stem for p in (ROOT / "benchmarks").glob("*.py")), key=len, reverse=True)
VARIANTS = ("quick", "smollm2", "bf16", "scan", "chain_sum_8steps", "products_8steps", "oolong_only")
# a machine's name in a file name -> its class: vendor and the widest instruction set the
# engine's kernels use there
CPU_CLASSES = {"zen3": "amd_avx2", "zen4": "amd_avx512_bf16", "xeon_noamx": "intel_avx512_bf16",
               "xeon_amx": "intel_amx"}


def parse(name: str) -> tuple[str, str, str | None]:
    """``(benchmark, variant, cpu token)`` of a results file name; AssertionError otherwise."""
    stem = name.removesuffix(".json")
    bench = next((b for b in BENCHMARKS if stem == b or stem.startswith(b + "_")), None)
    assert bench, f"{name}: no benchmarks/<script>.py of that name"
    rest = stem[len(bench) + 1:]
    cpu = next((c for c in CPU_CLASSES if rest == c or rest.endswith("_" + c)), None)
    variant = rest.removesuffix(cpu or "").rstrip("_")
    words = variant
    while words:
        word = next((v for v in VARIANTS if words == v or words.startswith(v + "_")), None)
        assert word, f"{name}: {words!r} is not a variant ({', '.join(VARIANTS)}) or a CPU class"
        words = words[len(word) + 1:]
    return bench, variant, cpu


def recorded_class(report: dict) -> str | None:
    """The CPU class the benchmark recorded itself (rollout_engine, engine_step), if any."""
    machine = report.get("machine") if isinstance(report, dict) else None
    if not isinstance(machine, dict) or "bf16_instructions" not in machine:
        return None
    vendor = "amd" if "AMD" in machine.get("cpu_model", "") else "intel"
    bf16 = machine["bf16_instructions"]
    isa = "amx" if "amx_bf16" in bf16 else "avx512_bf16" if "avx512_bf16" in bf16 else \
        machine.get("cpu_capability", "").lower()
    return f"{vendor}_{isa}"


def test_one_result_per_benchmark_variant_and_cpu_class():
    seen: dict[tuple, str] = {}
    for path in sorted(RESULTS.glob("*.json")):
        bench, variant, cpu = parse(path.name)
        recorded = recorded_class(json.loads(path.read_text()))
        named = CPU_CLASSES.get(cpu) if cpu else None
        assert named is None or recorded is None or named == recorded, \
            f"{path.name} is named for {named} but ran on {recorded}"
        key = (bench, variant, named or recorded or "unrecorded")
        assert key not in seen, f"{path.name} and {seen[key]}: keep the newer, git keeps the other"
        seen[key] = path.name


def test_the_names_refuse_one_off_runs():
    for name in ("rollout_engine_ee3fcc3.json", "web_load_quick_0032.json",
                 "rollout_engine_zen5_before.json", "vs_trl_smollm2_zen4_2.json"):
        try:
            parse(name)
        except AssertionError:
            continue
        raise AssertionError(f"{name} parsed")
    assert parse("vs_trl_smollm2_quick_xeon_amx.json") == ("vs_trl", "smollm2_quick", "xeon_amx")


def test_the_readme_lists_the_files_kept():
    readme = (RESULTS / "README.md").read_text()
    table = readme[readme.index("| file |"):readme.index("\n\n", readme.index("| file |"))]
    listed = set(re.findall(r"^\| `([\w.]+\.json)` \|", table, re.M))
    assert listed == {p.name for p in RESULTS.glob("*.json")}


def test_every_results_file_the_docs_name_exists_or_is_marked_as_history():
    named = re.compile(r"`(?:benchmarks/results/)?([a-z0-9_]+\.json)`( \(in git history\))?")
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]:
        for match in named.finditer(doc.read_text()):
            name, marked = match.groups()
            looks_like_result = any(name.startswith(b) for b in BENCHMARKS)
            if looks_like_result and not marked and not (RESULTS / name).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {name}")
    assert missing == []
