"""The kernel report behind `scripts/kernel_report.py`: every shipped decode-kernel configuration compiled
for each target without a GPU (`deviceless`), its registers, spills, shared memory, tensor-core use and
occupancy as rows and a Markdown table, and the searches that derive `launch.TABLE` (`sweep`) and fix
the classes that spill (`refit`).

A report row is one (configuration, target) compile: the configuration's name, the target, the launch
parameters the dispatch picks (`launch`), what ptxas reports (`deviceless.Resources`), `blocks_per_sm`
(the occupancy the register count and shared memory allow) and `ok` with the `problems` that fail it
(spills, too much shared memory, no compile).

`sweep` derives the launch table: for each class of `launch.LaunchKey` it compiles a representative
configuration (INT2 loops over an INT4 anchor, or INT2 alone; FP8 metadata, α and key means; as many
rows as the candidate's row block: more rows run more programs of the same code) and keeps the first
candidate that compiles clean for every target, trying the class's own row block before 16 rows, 4
warps before 8, and within those block_s 64, 32, 16 (num_stages 2): the largest tile that fits
without spilling, as few programs per query row as fit. Candidates are pruned by monotonicity: a class
with at least the head dim, links and row block of one already swept (same kernel and group size) does
not try a larger block_s than that one's clean choice at the same row block and warps. `table_source`
writes the table as Python for `pallas_kernels/launch.py` (where `OVERRIDES` is kept by hand).

`refit` takes the classes with a configuration that failed in a report, compiles every configuration of
each class (not one representative) under the sweep's candidates in its order, then the same with the
residual kernel's reconstructed-key path, and keeps the first that is clean on all of them for every
target (printed as `OVERRIDES` entries).

Like the rest of this package it imports nothing from rq_jax.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from pallas_kernels import configs, deviceless, launch

#: The sweep's candidate tiles (tokens per tile) and warps, tried largest tile first, fewer warps first.
BLOCK_S = (16, 32, 64)
WARPS = (4, 8)


def compile_row(cfg: configs.KernelConfig, target: deviceless.Target, cache, override=None) -> dict:
    """One report row: the config, its launch parameters (`override`, else the dispatch's) and what the
    target's compile reports (`cache`: the compile cache folder, None for the default)."""
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


def line(row: dict) -> str:
    """A report row as one log line: launch parameters, then the resources or why it failed."""
    launch_txt = f"bs {row['block_s']:2d} br {row['block_r']:2d} w{row['num_warps']} s{row['num_stages']}"
    if "registers" not in row:
        return f"{row['config']:48s} {row['target']} {launch_txt}  FAIL {row['problems'][0][:120]}"
    return (f"{row['config']:48s} {row['target']} {launch_txt}  smem {row['shared'] / 1024:6.1f} KB  "
            f"regs {row['registers']:3d}  spills {row['spill_stores']}/{row['spill_loads']}  "
            f"{row['tensor_cores']:5s} {row['blocks_per_sm']} blk/SM  {'ok' if row['ok'] else 'FAIL'}"
            f"  {row['seconds']:.1f}s")


def report(cfgs, targets, cache, log=print) -> list[dict]:
    """Every configuration of `cfgs` compiled for every target: the rows, each logged as it is done."""
    rows = []
    for cfg, target in itertools.product(cfgs, targets):
        row = compile_row(cfg, target, cache)
        rows.append(row)
        log(line(row))
    return rows


def summary(rows: list[dict]) -> str:
    """How many compiles were clean, then one indented line per failed one with its problems."""
    bad = [f"{r['config']} ({r['target']}): {'; '.join(r['problems'])}" for r in rows if not r["ok"]]
    return f"{len(rows)} compiles, {len(rows) - len(bad)} clean" + "".join(f"\n  {b}" for b in bad)


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
                log(line(row))
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
    `sweep_key` can bound a class's candidates by the smaller classes' results: {"table": {LaunchKey:
    Launch | None}, "rows": every row tried, with its class as "key"}."""
    table, rows, found = {}, [], {}
    for key in sorted(keys, key=lambda k: (family(k), k.dim, k.links, k.block_r)):
        chosen, tried = sweep_key(key, targets, cache, found.setdefault(family(key), {}), log)
        rows += [dict(r, key=list(key)) for r in tried]
        table[key] = chosen
        log(f"==> {key}: {chosen}")
    return dict(table=table, rows=rows)


# ---- the refit that fixes the classes that spill ----------------------------------------------------


def failed_keys(path: str | Path, cfgs=configs.MATRIX) -> list[launch.LaunchKey]:
    """The classes (sorted) of the configurations that failed in a report's JSON at `path`; ValueError
    when it is not a report or names configurations outside `cfgs` (default: configs.MATRIX)."""
    try:
        failed_names = {r["config"] for r in json.loads(Path(path).read_text())["rows"] if not r["ok"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"not a kernel_report.py JSON report ({type(err).__name__}: {err})") from None
    by_name = {c.name: c for c in cfgs}
    if unknown := sorted(failed_names - by_name.keys()):
        raise ValueError(f"configurations not in the matrix reported: {', '.join(unknown[:3])}")
    return sorted({by_name[name].launch_key() for name in failed_names} - {None})


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
            log(line(row) + ("  reconstructed keys" if cand.dequant_keys else ""))
            if not row["ok"]:
                break
        else:
            return cand, tried
    return None, tried


def refit(keys, targets, cache, log=print, cfgs=configs.MATRIX) -> dict:
    """`refit_key` of every class in `keys` on all its configurations of `cfgs` (default configs.MATRIX;
    the paged matrix for `launch.PAGED_OVERRIDES`): {"table": {LaunchKey: Launch | None}, "rows": every row
    tried, with its class as "key"}."""
    table, rows = {}, []
    for key in keys:
        members = [c for c in cfgs if c.launch_key() == key]
        table[key], tried = refit_key(key, members, targets, cache, log)
        rows += [dict(r, key=list(key)) for r in tried]
        log(f"==> {key}: {table[key]}")
    return dict(table=table, rows=rows)


def table_json(table: dict) -> list:
    """A {LaunchKey: Launch | None} table as JSON-able [key, launch] pairs, sorted."""
    return [[list(k), None if v is None else list(v)] for k, v in sorted(table.items())]


def table_source(table: dict, name: str = "TABLE") -> str:
    """A {LaunchKey: Launch | None} table as the Python of `launch.py` (`name: dict[...] = {...}`), sorted;
    classes without a clean launch (None) left out."""
    lines = [f"{name}: dict[LaunchKey, Launch] = {{"]
    for key, lp in sorted(table.items()):
        if lp is not None:
            lines.append(f"    LaunchKey{tuple(key)!r}: Launch{tuple(lp)!r},")
    return "\n".join(lines + ["}"])
