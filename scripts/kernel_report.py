"""Registers, spills, shared memory and tensor-core use of every shipped decode-kernel configuration,
compiled for Hopper (sm_90) and Ampere (sm_80) without a GPU; markdown + JSON.

    python scripts/kernel_report.py --json kernels.json --markdown kernels.md       # the whole matrix
    python scripts/kernel_report.py --only huginn ouro                              # names containing these
    python scripts/kernel_report.py --ci-subset                                     # what the tests compile
    python scripts/kernel_report.py --sweep --json sweep.json                       # re-derive launch.TABLE
    python scripts/kernel_report.py --refit kernels.json                            # fix the classes that spill
    python scripts/kernel_report.py --shard 0/2 & python scripts/kernel_report.py --shard 1/2   # in parallel

Each configuration of `pallas_kernels.configs.MATRIX` (every call the dispatch can make for the shipped
cache policies) is lowered by jax for the "cuda" platform at the target's compute capability and run
through the pip `triton` wheel's CUDA stages and its ptxas (`pallas_kernels.deviceless`), with the
launch parameters the dispatch picks (`pallas_kernels.launch`). Results are cached by IR hash
(--cache, default $RQ_KERNEL_CACHE or ~/.cache/rq_jax/kernels), so a rerun only compiles what changed.
The exit status is 1 when any configuration spills, needs more shared memory than its target has, or
does not compile.

`blocks/SM` is the occupancy the register count and shared memory allow (`deviceless.blocks_per_sm`).

--sweep derives the launch table: for each class of `launch.LaunchKey` it compiles a representative
configuration (INT2 loops over an INT4 anchor, or INT2 alone; FP8 metadata, α and key means; as many
rows as the candidate's row block: more rows run more programs of the same code) and keeps the first
candidate that compiles clean for every target, trying the class's own row block before 16 rows, 4
warps before 8, and within those block_s 64, 32, 16 (num_stages 2): the largest tile that fits
without spilling, as few programs per query row as fit. Candidates are pruned by monotonicity: a class
with at least the head dim, links and row block of one already swept (same kernel and group size) does
not try a larger block_s than that one's clean choice at the same row block and warps. It prints the
table as Python for `pallas_kernels/launch.py` (where `OVERRIDES` is kept by hand).

--refit REPORT takes a report's JSON and, for every class with a configuration that failed there, compiles
every configuration of the class (not one representative) under the sweep's candidates in its order, then
the same with the residual kernel's reconstructed-key path, and keeps the first that is clean on all of
them for every target; it prints those classes as `OVERRIDES` entries.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import configs, deviceless, launch  # noqa: E402
from rq_jax import cli  # noqa: E402


def compile_row(cfg: configs.KernelConfig, target: deviceless.Target, cache, override=None) -> dict:
    """One report row: the config, its launch parameters and what the target's compile reports."""
    lp = override or cfg.launch()
    row = dict(config=cfg.name, target=target.name, block_s=lp.block_s, block_r=min(launch.row_block(cfg.rows),
               lp.max_block_r), num_warps=lp.num_warps, num_stages=lp.num_stages)
    try:
        res = cfg.compile(target, cache, override)
    except (deviceless.CompileError, NotImplementedError) as e:
        return row | dict(ok=False, problems=[f"does not compile: {e}"[:500]])
    problems = deviceless.problems(res)
    return row | res.as_dict() | dict(blocks_per_sm=deviceless.blocks_per_sm(res), ok=not problems,
                                      problems=problems)


def report(cfgs, targets, cache, log=print) -> list[dict]:
    rows = []
    for cfg, target in itertools.product(cfgs, targets):
        row = compile_row(cfg, target, cache)
        rows.append(row)
        log(_line(row))
    return rows


def _line(row: dict) -> str:
    launch_txt = f"bs {row['block_s']:2d} br {row['block_r']:2d} w{row['num_warps']} s{row['num_stages']}"
    if "registers" not in row:
        return f"{row['config']:48s} {row['target']} {launch_txt}  FAIL {row['problems'][0][:120]}"
    return (f"{row['config']:48s} {row['target']} {launch_txt}  smem {row['shared'] / 1024:6.1f} KB  "
            f"regs {row['registers']:3d}  spills {row['spill_stores']}/{row['spill_loads']}  "
            f"{row['tensor_cores']:5s} {row['blocks_per_sm']} blk/SM  {'ok' if row['ok'] else 'FAIL'}"
            f"  {row['seconds']:.1f}s")


def _cell(row: dict | None) -> str:
    if row is None:
        return "—"
    if "registers" not in row:
        return "**does not compile**"
    spill = f"{row['spill_stores']} / {row['spill_loads']}"
    return (f"{row['shared'] / 1024:.1f} KB · {row['registers']} · {spill if row['ok'] else f'**{spill}**'} · "
            f"{row['tensor_cores']} · {row['blocks_per_sm']}")


def markdown(rows: list[dict], versions: dict) -> str:
    """The report as a markdown table, one line per configuration with both targets side by side."""
    targets = list(dict.fromkeys(r["target"] for r in rows))
    by = {(r["config"], r["target"]): r for r in rows}
    head = (f"Triton {versions['triton']} (ptxas {versions['ptxas']}), jax {versions['jax']}, "
            f"jaxlib {versions['jaxlib']}. Cells: shared memory · registers · spill bytes stored / loaded · "
            f"tensor-core instructions · blocks per SM.\n\n")
    lines = ["| configuration | block_s · rows · warps · stages | " + " | ".join(targets) + " |",
             "|---|---|" + "---|" * len(targets)]
    for name in dict.fromkeys(r["config"] for r in rows):
        first = next(by[(name, t)] for t in targets if (name, t) in by)
        lp = f"{first['block_s']} · {first['block_r']} · {first['num_warps']} · {first['num_stages']}"
        lines.append(f"| {name} | {lp} | " + " | ".join(_cell(by.get((name, t))) for t in targets) + " |")
    return head + "\n".join(lines) + "\n"


# ---- the sweep that derives launch.TABLE ------------------------------------------------------------


def representative(key: launch.LaunchKey, block_r: int) -> configs.KernelConfig:
    """The configuration a class's launch parameters are chosen on, for a candidate's row block: as many
    rows as that block holds (a class's rows beyond it run as more programs of the same code, so its
    candidates with smaller row blocks share the compiles of the smaller classes)."""
    key = key._replace(block_r=min(key.block_r, block_r))
    if key.kernel.startswith("dense"):
        return configs.KernelConfig(f"sweep-{key.kernel}-d{key.dim}-r{key.block_r}", key.dim, key.block_r,
                                    kv=key.kernel.removeprefix("dense-"))
    links = ((2, key.group),) * (key.links - 1) + ((4 if key.links > 1 else 2, key.group),)
    return configs.KernelConfig(f"sweep-d{key.dim}-r{key.block_r}-{configs.chain_name(links)}", key.dim,
                                key.block_r, links)


def candidate_groups(block_r: int) -> list[list[launch.Launch]]:
    """Candidates in order of preference: the class's own row block before 16 rows, 4 warps before 8;
    within a group the largest tile first."""
    blocks = [block_r] if block_r == launch.ROW_BLOCKS[0] else [block_r, launch.ROW_BLOCKS[0]]
    return [[launch.Launch(bs, nw, 2, br) for bs in BLOCK_S[::-1]] for br in blocks for nw in WARPS]


BLOCK_S = (16, 32, 64)
WARPS = (4, 8)


def sweep_key(key: launch.LaunchKey, targets, cache, found: dict, log=print) -> tuple[launch.Launch | None, list]:
    """The chosen launch parameters of one class (None: no candidate is clean) and every row tried:
    the first clean candidate on every target, in `candidate_groups` order.

    `found` holds what the classes of the same family swept before found: per (head dim, links, row
    block, warps), the largest clean block_s (0: none). A class with at least the head dim, links and
    row block of one of them needs at least as many registers per tile, so candidates above that
    block_s are not compiled (a pruning assumption: the chosen candidate itself is always compiled on
    every target). This class's results are added."""
    tried = []
    for group in candidate_groups(key.block_r):
        br, nw = group[0].max_block_r, group[0].num_warps
        bound = min((bs for (d, n, b, w), bs in found.items()
                     if d <= key.dim and n <= key.links and b <= br and w == nw), default=BLOCK_S[-1])
        for cand in group:
            if cand.block_s > bound:
                continue
            for target in targets:  # stop at the first target it fails on
                row = compile_row(representative(key, br), target, cache, cand)
                tried.append(row)
                log(_line(row))
                if not row["ok"]:
                    break
            else:
                found[(key.dim, key.links, br, nw)] = cand.block_s
                return cand, tried
        found[(key.dim, key.links, br, nw)] = 0
    return None, tried


def family(key: launch.LaunchKey) -> tuple:
    """The classes that differ only in head dim, chain links and row block."""
    return key.kernel, key.group


def sweep(keys, targets, cache, log=print) -> dict:
    """Sweep every class, each family's in ascending (head dim, links, row block) order, so that
    `sweep_key` can bound a class's candidates by the smaller classes' results."""
    table, rows, found = {}, [], {}
    for key in sorted(keys, key=lambda k: (family(k), k.dim, k.links, k.block_r)):
        chosen, tried = sweep_key(key, targets, cache, found.setdefault(family(key), {}), log)
        rows += [dict(r, key=list(key)) for r in tried]
        table[key] = chosen
        log(f"==> {key}: {chosen}")
    return dict(table=table, rows=rows)


def refit_key(key: launch.LaunchKey, cfgs, targets, cache, log=print) -> tuple[launch.Launch | None, list]:
    """The first candidate (`candidate_groups` order, then with `dequant_keys` for the residual kernel) on
    which every configuration in `cfgs` (one class's) compiles clean for every target, and every row tried."""
    cands = [c for group in candidate_groups(key.block_r) for c in group]
    if key.kernel == "residual":
        cands += [c._replace(dequant_keys=True) for c in cands]
    tried = []
    for cand in cands:
        for cfg, target in itertools.product(cfgs, targets):  # stop at the first failure
            row = compile_row(cfg, target, cache, cand)
            tried.append(row)
            log(_line(row) + ("  reconstructed keys" if cand.dequant_keys else ""))
            if not row["ok"]:
                break
        else:
            return cand, tried
    return None, tried


def table_json(table: dict) -> list:
    """A {LaunchKey: Launch | None} table as JSON-able [key, launch] pairs, sorted."""
    return [[list(k), None if v is None else list(v)] for k, v in sorted(table.items())]


def table_source(table: dict, name: str = "TABLE") -> str:
    lines = [f"{name}: dict[LaunchKey, Launch] = {{"]
    for key, lp in sorted(table.items()):
        if lp is not None:
            lines.append(f"    LaunchKey{tuple(key)!r}: Launch{tuple(lp)!r},")
    return "\n".join(lines + ["}"])


# ---- main -------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", default=list(deviceless.TARGETS), choices=list(deviceless.TARGETS))
    p.add_argument("--only", nargs="+", default=None, help="configurations whose name contains any of these")
    p.add_argument("--ci-subset", action="store_true", help="only configs.CI_SUBSET (what the tests compile)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="only every N-th configuration (--sweep: family of classes) from the I-th (0-based)")
    p.add_argument("--cache", default=None, help="compile cache directory (default: deviceless.default_cache_dir())")
    p.add_argument("--sweep", action="store_true", help="derive launch.TABLE instead of reporting the matrix")
    p.add_argument("--refit", metavar="REPORT", default=None,
                   help="a report's JSON: find launch parameters for the classes that failed there")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    if not deviceless.triton_available():
        print("kernel_report.py needs the pip `triton` wheel: pip install -e '.[test]'", file=sys.stderr)
        return 2
    targets = [deviceless.TARGETS[t] for t in args.targets]
    cfgs = [c for c in configs.MATRIX if args.only is None or any(s in c.name for s in args.only)]
    if args.ci_subset:
        cfgs = [c for c in cfgs if c.name in configs.CI_SUBSET]
    i, n = map(int, args.shard.split("/")) if args.shard else (0, 1)
    versions = deviceless.toolchain_versions()
    start = time.perf_counter()
    if args.refit:
        try:
            failed_names = {r["config"] for r in json.loads(Path(args.refit).read_text())["rows"] if not r["ok"]}
        except (OSError, ValueError, KeyError, TypeError) as err:
            p.error(f"--refit {args.refit}: not a kernel_report.py JSON report ({type(err).__name__}: {err})")
        if unknown := sorted(failed_names - configs.BY_NAME.keys()):
            p.error(f"--refit {args.refit}: configurations not in configs.MATRIX: {', '.join(unknown[:3])}")
        keys = sorted({configs.BY_NAME[name].launch_key() for name in failed_names} - {None})
        table, rows = {}, []
        for key in keys[i::n]:
            members = [c for c in configs.MATRIX if c.launch_key() == key]
            table[key], tried = refit_key(key, members, targets, args.cache)
            rows += [dict(r, key=list(key)) for r in tried]
            print(f"==> {key}: {table[key]}")
        print(table_source(table, "OVERRIDES"))
        result = dict(versions=versions, table=table_json(table), rows=rows)
        failed = any(v is None for v in table.values())
    elif args.sweep:
        keys = {c.launch_key() for c in cfgs} - {None}
        families = sorted({family(k) for k in keys})[i::n]
        keys = [k for k in keys if family(k) in families]
        out = sweep(keys, targets, args.cache)
        print(table_source(out["table"]))
        result = dict(versions=versions, table=table_json(out["table"]), rows=out["rows"])
        failed = any(v is None for v in out["table"].values())
    else:
        rows = report(cfgs[i::n], targets, args.cache)
        result = dict(versions=versions, rows=rows)
        failed = not all(r["ok"] for r in rows)
        bad = [f"{r['config']} ({r['target']}): {'; '.join(r['problems'])}" for r in rows if not r["ok"]]
        print(f"{len(rows)} compiles, {len(rows) - len(bad)} clean" + "".join(f"\n  {b}" for b in bad))
        if args.markdown:
            Path(args.markdown).write_text(markdown(rows, versions))
    print(f"{time.perf_counter() - start:.0f} s; {versions}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
