"""bench_core's engines and labels, and its report: the medians per operation and engine
(:func:`aggregate`), the targets against the machine's limits (:func:`targets`) and the
Markdown report (:func:`report`). Pure functions over the samples tools/bench_core.py's child
processes measured; nothing here runs a child.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from harness import GB, MiB, Stats, fmt, header, table

RESULT_PREFIX = "BENCH_CORE_RESULT "
WRITE_SIZES_MIB = (4, 16, 64)
READ_SIZE = 16 * MiB
MEM_CHUNKS = 4
MEM_METADATA = 16 * MiB
SEED = 1234
COOL_DOWN_S = 4.0

SAVE_ENGINES = ("ckptstore", "torch", "torch_nocrc", "safetensors", "dcp")
LOAD_ENGINES = ("ckptstore", "ckptstore_into", "torch", "safetensors", "dcp")
RESTORE_ENGINES = ("ckptstore", "dcp")
SAVE_LABELS = {"ckptstore": "ckptstore save", "torch": "torch.save",
               "torch_nocrc": "torch.save (crc32 off)", "safetensors": "safetensors save_file",
               "dcp": "DCP save"}
LOAD_LABELS = {"ckptstore": "ckptstore load", "ckptstore_into": "ckptstore load into (prealloc)",
               "torch": "torch.load(weights_only)",
               "safetensors": "safetensors load_file(pread)", "dcp": "DCP load (prealloc)"}
PEERS = (("torch", "x torch"), ("safetensors", "x safet."), ("dcp", "x DCP"))


# ---- aggregation -------------------------------------------------------------------------------
def med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / GB if seconds else None


def aggregate(samples: dict[str, list[dict]], total: int) -> dict[str, Any]:
    """Medians per operation: seconds, GB/s, peak extra memory; limits; incremental fractions."""
    lim = samples["limits"]
    keys = sorted({k for row in lim for k in row if k.endswith("_s")}, key=limit_order)
    limits = {k: {"seconds": med(lim, k), "gbps": gbps(total, med(lim, k))} for k in keys}
    disk = max(limits[f"write_{m}_s"]["gbps"] or 0 for m in WRITE_SIZES_MIB)
    ops: dict[str, Any] = {}
    for key, rows in samples.items():
        if key == "limits" or not rows:
            continue
        s = med(rows, "seconds")
        ops[key] = {"n": len(rows), "seconds": s, "gbps": gbps(total, s),
                    "peak_extra": med(rows, "peak_extra"),
                    "workers": max(r.get("workers", 1) for r in rows),
                    "spread": Stats.of(r["seconds"] for r in rows).as_dict()}
    ck = samples["save:ckptstore"]
    incr = {"seconds": med(ck, "incr_seconds"), "written": med(ck, "incr_written"),
            "full_written": med(ck, "written"), "peak_extra": med(ck, "incr_peak_extra"),
            "bytes_fraction": statistics.median(r["incr_written"] / r["written"] for r in ck),
            "time_fraction": statistics.median(r["incr_seconds"] / r["seconds"] for r in ck),
            "chunk_size": ck[0]["chunk_size"]}
    return {"limits": limits, "disk_fsync_gbps": disk, "ops": ops, "incremental": incr}


def targets(agg: dict[str, Any], caches: list[str]) -> list[dict[str, Any]]:
    ops, inc = agg["ops"], agg["incremental"]
    chunk = inc["chunk_size"]
    save = ops["save:ckptstore"]
    out = [
        target("full save >= torch.save throughput", save["gbps"] / ops["save:torch"]["gbps"], ">=", 1.0,
               f"{save['gbps']:.2f} vs {ops['save:torch']['gbps']:.2f} GB/s"),
        target("full save >= 70% of disk fsync'd bandwidth", save["gbps"] / agg["disk_fsync_gbps"], ">=",
               0.70, f"{save['gbps']:.2f} of {agg['disk_fsync_gbps']:.2f} GB/s"),
        target("10%-changed save writes <= 12% of a full save's bytes", inc["bytes_fraction"], "<=", 0.12,
               f"{inc['written'] / MiB:.1f} of {inc['full_written'] / MiB:.1f} MiB"),
        target("10%-changed save takes <= 25% of a full save's time", inc["time_fraction"], "<=", 0.25,
               f"{inc['seconds']:.3f} of {save['seconds']:.3f} s"),
    ]
    for cache in caches:
        mine, peer = ops.get(f"load:ckptstore:{cache}"), ops.get(f"load:torch:{cache}")
        if mine and peer:
            out.append(target(f"load ({cache}) >= torch.load throughput", mine["gbps"] / peer["gbps"],
                              ">=", 1.0, f"{mine['gbps']:.2f} vs {peer['gbps']:.2f} GB/s"))
    for cache in caches:
        for kind, mine_key, what in (("load", "ckptstore_into", "load into preallocated tensors"),
                                     ("restore", "ckptstore", "restore into a live model + AdamW")):
            mine, peer = ops.get(f"{kind}:{mine_key}:{cache}"), ops.get(f"{kind}:dcp:{cache}")
            if mine and peer:
                out.append(target(f"{what} ({cache}) >= 1.2x DCP", mine["gbps"] / peer["gbps"],
                                  ">=", 1.2, f"{mine['seconds']:.3f} vs {peer['seconds']:.3f} s"))
    budget = MEM_CHUNKS * chunk * save["workers"] + MEM_METADATA
    out.append(target(f"save peak extra RSS <= {MEM_CHUNKS} chunks x {save['workers']} thread(s) + "
                      f"{MEM_METADATA // MiB} MiB", save["peak_extra"] / MiB, "<=", budget / MiB,
                      "MiB over the RSS before the save"))
    for cache in caches:
        load = ops.get(f"load:ckptstore:{cache}")
        if load:
            budget = MEM_CHUNKS * chunk * load["workers"] + MEM_METADATA
            out.append(target(f"load ({cache}) peak <= state + {MEM_CHUNKS} chunks x {load['workers']} "
                              f"thread(s) + {MEM_METADATA // MiB} MiB", load["peak_extra"] / MiB, "<=",
                              budget / MiB, "MiB over the state's size"))
    return out


def target(name: str, actual: float, op: str, limit: float, detail: str) -> dict[str, Any]:
    ok = actual >= limit if op == ">=" else actual <= limit
    return {"target": name, "actual": actual, "op": op, "limit": limit, "pass": ok, "detail": detail}


# ---- report ------------------------------------------------------------------------------------
LIMIT_NAMES = {
    **{f"write_{m}_s": f"disk write+fsync, {m} MiB writes" for m in WRITE_SIZES_MIB},
    "write_direct_s": "disk write+fsync, O_DIRECT 16 MiB (info)",
    "write_hot_s": "disk write+fsync, 16 MiB, page cache just freed (info)",
    "read_cold_s": "disk read, cold (16 MiB reads)",
    "read_warm_s": "page-cache read (16 MiB reads)",
    "memcpy_s": "memcpy into preallocated tensors (best of 3)",
    "clone_s": "copy into fresh allocation (clone)",
}


def limit_order(key: str) -> int:
    return list(LIMIT_NAMES).index(key) if key in LIMIT_NAMES else len(LIMIT_NAMES)


def limits_table(agg: dict[str, Any]) -> str:
    rows = [[LIMIT_NAMES.get(k, k), fmt(v["seconds"], ".3f"), fmt(v["gbps"])]
            for k, v in agg["limits"].items()]
    return table(["machine limit", "median s", "GB/s"], rows)


def ops_table(agg: dict[str, Any], kind: str, cache: str = "") -> str:
    ops = agg["ops"]
    suffix = f":{cache}" if cache else ""
    engines, labels = (SAVE_ENGINES, SAVE_LABELS) if kind == "save" else (LOAD_ENGINES, LOAD_LABELS)
    if kind == "save":
        ref, ref_name = agg["disk_fsync_gbps"], "of disk fsync"
    else:
        ref = agg["limits"].get(f"read_{cache}_s", {}).get("gbps")
        ref_name = f"of {cache} read"
    rows = []
    for e in engines:
        op = ops.get(f"{kind}:{e}{suffix}")
        if not op:
            continue
        ratios = []
        for peer, _ in PEERS:
            p = ops.get(f"{kind}:{peer}{suffix}")
            ratios.append(fmt(op["gbps"] / p["gbps"]) if p and p["gbps"] else "-")
        spread = Stats(**op["spread"]).spread()
        rows.append([labels[e], fmt(op["seconds"], ".3f"), spread, fmt(op["gbps"]), *ratios,
                     fmt(op["gbps"] / ref if ref else None), fmt(op["peak_extra"] / MiB, ".1f")])
    mem = "peak extra MiB" if kind == "save" else "peak - state MiB"
    return table([f"{kind} ({cache})" if cache else kind, "median s", "min-max s", "GB/s",
                  *(h for _, h in PEERS), ref_name, mem], rows)


def restore_table(agg: dict[str, Any]) -> str:
    ops = agg["ops"]
    rows = []
    for cache in ("cold", "warm"):
        for e, label in (("ckptstore", "ckptstore Checkpointer.restore()"),
                         ("dcp", "DCP get_state_dict + load + set_state_dict")):
            op, peer = ops.get(f"restore:{e}:{cache}"), ops.get(f"restore:dcp:{cache}")
            if op:
                rows.append([f"{label} ({cache})", fmt(op["seconds"], ".3f"), fmt(op["gbps"]),
                             fmt(op["gbps"] / peer["gbps"] if peer else None),
                             fmt(op["peak_extra"] / MiB, ".1f"), str(op["n"])])
    return table(["restore into a live model + AdamW", "median s", "GB/s", "x DCP",
                  "peak extra MiB", "n"], rows) if rows else ""


def incremental_table(agg: dict[str, Any]) -> str:
    inc = agg["incremental"]
    row = ["ckptstore save, 10% of tensors changed", fmt(inc["seconds"], ".3f"),
           fmt(inc["written"] / MiB, ".1f"), fmt(100 * inc["bytes_fraction"], ".1f"),
           fmt(100 * inc["time_fraction"], ".1f"), fmt(inc["peak_extra"] / MiB, ".1f")]
    return table(["incremental", "median s", "written MiB", "% full bytes", "% full time",
                  "peak extra MiB"], [row])


def targets_table(ts: list[dict[str, Any]]) -> str:
    rows = [["PASS" if t["pass"] else "FAIL", t["target"], f"{t['actual']:.3f} {t['op']} {t['limit']:.3f}",
             t["detail"]] for t in ts]
    return table(["", "issue target", "actual vs limit", "numbers (medians)"], rows, left=2)


def profile_text(samples: dict[str, list[dict]]) -> str:
    prof = next((r["profile"] for r in samples["save:ckptstore"] if r.get("profile")), None)
    if not prof:
        return ""
    rows = [[p["function"], str(p["calls"]), fmt(p["tottime"], ".3f"), fmt(p["cumtime"], ".3f")]
            for p in prof]
    return "cProfile of the first ckptstore full save (top by own time):\n" + table(
        ["function", "calls", "tottime s", "cumtime s"], rows)


def report(env: dict[str, Any], a: argparse.Namespace, total: int, agg: dict[str, Any],
           ts: list[dict[str, Any]], caches_note: str, samples: dict[str, list[dict]]) -> str:
    head = [header(f"bench_core: {a.tensors} float32 tensors, {total / MiB:.1f} MiB "
                   f"({total / GB:.3f} GB), {a.rounds} rounds, medians; ratios 'x peer' = "
                   "throughput / the peer's (>1 faster)", env),
            f"  load caches: {caches_note}", ""]
    parts = [limits_table(agg), "", f"disk fsync'd bandwidth (best write size): {agg['disk_fsync_gbps']:.2f} GB/s",
             "", ops_table(agg, "save"), "", incremental_table(agg), ""]
    for cache in ("cold", "warm"):
        if any(k.endswith(f":{cache}") for k in agg["ops"]):
            parts += [ops_table(agg, "load", cache), ""]
    restore = restore_table(agg)
    if restore:
        parts += [restore, ""]
    parts += [targets_table(ts)]
    prof = profile_text(samples)
    if prof:
        parts += ["", prof]
    return "\n".join(head + parts)
