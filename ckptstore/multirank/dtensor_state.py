"""DTensor state dicts on a job store (format-spec/format.md §22.8): ``store.save(it, state)``
where ``state`` holds DTensors anywhere (an FSDP2 model's ``state_dict()``, its optimizer's).

Each rank writes its *local* shards, as the sharded Checkpointer does (format-spec/deltas.md,
"Sharded states": the same BOX per tensor, the same owners for replicated boxes); the part's
top-level key :data:`SECTION_KEY` says where each shard lies::

    {"v": 1, "rank": r, "world": N,
     "tensors": {PATH: BOX, ...},     # every DTensor of the state, PATH = JSON list of its keys
     "replicas": {PATH: owner, ...}}  # boxes other ranks hold too; only the owner writes them

A rank that does not own a replicated box stores None at its path. Invariants:

* saving is :func:`sharded_part` (pure, no collective: every rank computes the same owners from
  the DTensors' global shapes, meshes and placements), run inside the save's commit round, so a
  rank that cannot make its part votes FAILED and every rank raises (nothing is committed);
* a reader with no group gets whole tensors (:func:`assemble`), after the boxes of every tensor
  were found to tile it (:func:`ckptstore.replay.shards.layout_problems`);
* :func:`load_into` fills live DTensors (any mesh, any world size) and plain tensors, reading
  from each rank's stream only the byte span of each stored shard that overlaps the live box
  (chunk-granular: :func:`ckptstore.engine.read_path.read_ranges`), never a whole part.

Call sequences. Save (every rank, :meth:`JobStore.save` / ``save_async``): 1. :func:`rank_part`
finds the DTensors, checks their meshes, computes the owners and swaps in the local shards; 2. the
part is saved as any state, in one global round (a failure in 1 is this rank's FAILED vote).
Whole load (:mod:`.combine`): 1. every part is loaded; 2. :func:`check_sections`; 3. each tensor
is assembled from the rank that wrote each box (:func:`writers`). Load into (:func:`load_into`):
1. every rank's section (no tensor) and manifest are read and checked; 2. every target is
checked and the overlap of each live box with each stored box planned; 3. each rank's spans are
read (the reader's own part's other tensors with them); 4. the scratch spans are copied into the
targets; 5. the other tensors are copied into ``into``'s as :meth:`Store.load` does.

Limits: the overlaps are read into scratch and copied (never straight into the live tensor);
``keys`` selects the shard targets, but every other tensor of the reader's part is read.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from ..engine.read_path import RangeRead, box_span, read_ranges
from ..errors import (DamagedCheckpointError, RankMismatchError, TargetMismatchError,
                      UnsupportedTypeError)
from ..format.state import MAX_DEPTH, Path, format_path, leaf_paths, top_level_items, unflatten
from ..replay.shards import (Holding, assemble_tensor, box_of, holdings_of, is_dtensor,
                             layout_problems, local, mesh_ranks, meet, region, replica_owners)
from ..store import select_keys
from ..tensors import TORCH_DTYPES, allocate, finish
from ..tensors.inplace import copy_into, lookup

if TYPE_CHECKING:
    from ..store import Store
    from .job_store import JobStore

SECTION_KEY = "ckptstore.shards"
SECTION_VERSION = 1
_SAME = object()


def path_key(path: Path) -> str:
    """A tensor's key in the section: its path as a JSON list (keeps ``0`` and ``"0"`` apart)."""
    return json.dumps(list(path), separators=(",", ":"))


def key_path(key: str) -> Path:
    """The path a section key names; DamagedCheckpointError for a malformed one."""
    try:
        keys = json.loads(key)
    except ValueError:
        keys = None
    if type(keys) is not list or not all(type(k) in (str, int) for k in keys):
        raise DamagedCheckpointError(f"the sharded-state section names a malformed path {key!r}")
    return tuple(keys)


def _rebuild(node: Any, pick: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """``node`` with every value for which ``pick(path, value)`` returns something other than
    ``_SAME`` replaced by it; containers on the way are copied (dict subclasses with their
    attributes, e.g. ``_metadata``), the caller's are never changed."""
    got = pick(path, node)
    if got is not _SAME:
        return got
    if len(path) > MAX_DEPTH:
        return node
    if isinstance(node, dict):
        out = copy.copy(node)
        for k, v in node.items():
            out[k] = _rebuild(v, pick, path + (k,))
        return out
    if type(node) is list:
        return [_rebuild(v, pick, path + (i,)) for i, v in enumerate(node)]
    if type(node) is tuple:
        return tuple(_rebuild(v, pick, path + (i,)) for i, v in enumerate(node))
    return node


def values(state: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every value of a nested state that is not a dict, list or tuple, with its path, in order
    (a tensor, a DTensor, a scalar)."""
    if isinstance(state, dict) and len(path) <= MAX_DEPTH:
        for k, v in state.items():
            yield from values(v, path + (k,))
    elif type(state) in (list, tuple) and len(path) <= MAX_DEPTH:
        for i, v in enumerate(state):
            yield from values(v, path + (i,))
    else:
        yield path, state


def dtensors(state: Any) -> list[tuple[Path, Any]]:
    """Every DTensor of a nested state with its path, in order."""
    return [(p, v) for p, v in values(state) if is_dtensor(v)]


def sharded_part(state: Any, rank: int, world: int, store_ranks: Sequence[int]) -> Any:
    """This rank's part of a state holding DTensors (the state itself when it holds none): each
    DTensor replaced by its local shard (a replicated box another rank owns: None), and the
    section at :data:`SECTION_KEY`. ``store_ranks``: the global ranks of the job store's group,
    in rank order. Raises, before anything is written, RankMismatchError for a DTensor whose mesh
    is not the job store's ranks, UnsupportedTypeError for a state that is not a dict, one that
    uses :data:`SECTION_KEY` itself, or a placement with no stored form (``Partial``)."""
    found = dtensors(state)
    if not found:
        return state
    if not isinstance(state, dict) or SECTION_KEY in state:
        raise UnsupportedTypeError(f"a state holding DTensors must be a dict without the key "
                                   f"{SECTION_KEY!r} (found a DTensor at {format_path(found[0][0])})")
    ranks = sorted(int(g) for g in store_ranks)
    store_rank = {int(g): r for r, g in enumerate(store_ranks)}
    boxes: dict[str, dict] = {}
    holdings: list[Holding] = []
    for path, t in found:
        key = path_key(path)
        if mesh_ranks(t) != ranks:
            raise RankMismatchError(f"the DTensor at {format_path(path)} is sharded over the "
                                    f"device mesh of global ranks {mesh_ranks(t)}, but the job "
                                    f"store's process group holds ranks {ranks}: open the store "
                                    "with the process group the mesh spans")
        boxes[key] = box_of(t)
        holdings += holdings_of(key, t, store_rank) or []
    replicas = replica_owners(holdings, world, rank)

    def swap(path: Path, v: Any) -> Any:
        if not is_dtensor(v):
            return _SAME
        return local(v) if replicas.get(path_key(path), rank) == rank else None

    part = _rebuild(state, swap)
    part[SECTION_KEY] = {"v": SECTION_VERSION, "rank": rank, "world": world, "tensors": boxes,
                         "replicas": replicas}
    return part


def rank_part(store: "JobStore", state: Any) -> Any:
    """What this rank of writer ``store`` saves of ``state``: :func:`sharded_part` over the job
    store's process group (the state itself when it holds no DTensor)."""
    group = store.group
    if group is None:
        return state
    import torch.distributed as dist

    return sharded_part(state, group.rank, group.world_size,
                        dist.get_process_group_ranks(group.group))


def section_of(state: Any) -> dict | None:
    """The section of a part of a DTensor state, or None for any other state."""
    sec = state.get(SECTION_KEY) if isinstance(state, dict) else None
    return sec if isinstance(sec, dict) else None


def check_sections(sections: Sequence[Any], where: str) -> list[dict]:
    """The sections of one iteration's parts (rank order), checked: one per rank, each naming
    its rank and the world, the same tensors, owners inside the world, and boxes that tile every
    tensor. Raises DamagedCheckpointError (ShardCoverageError for boxes that do not tile)."""
    world = len(sections)
    out: list[dict] = []
    for r, sec in enumerate(sections):
        if not isinstance(sec, dict) or sec.get("v") != SECTION_VERSION or \
                sec.get("rank") != r or sec.get("world") != world or \
                not isinstance(sec.get("tensors"), dict) or not isinstance(sec.get("replicas"), dict):
            raise DamagedCheckpointError(f"{where}rank {r}'s part is not a part {r} of {world} of "
                                         "a sharded (DTensor) state")
        if out and set(sec["tensors"]) != set(out[0]["tensors"]):
            raise DamagedCheckpointError(f"{where}rank {r}'s part records other DTensors than "
                                         "rank 0's")
        if any(type(o) is not int or not 0 <= o < world for o in sec["replicas"].values()):
            raise DamagedCheckpointError(f"{where}rank {r}'s part names an owner outside the "
                                         f"{world} ranks")
        out.append(sec)
    problems = layout_problems(out, where)
    if problems:
        raise problems[0]
    return out


def writers(sections: Sequence[dict], key: str, where: str) -> list[tuple[int, dict]]:
    """``(rank, BOX)`` of every distinct box of tensor ``key``, from the rank that wrote it (a
    replicated box: its owner, which must have claimed it). DamagedCheckpointError when no rank
    wrote a box."""
    out: dict[tuple, tuple[int, dict]] = {}
    every: set[tuple] = set()
    for r, sec in enumerate(sections):
        b = sec["tensors"][key]
        box = (tuple(b["offsets"]), tuple(b["local"]))
        every.add(box)
        if sec["replicas"].get(key, r) == r:
            out.setdefault(box, (r, b))
    missing = sorted(every - set(out))
    if missing:
        raise DamagedCheckpointError(f"{where}no rank wrote the box at offsets "
                                     f"{list(missing[0][0])} (shape {list(missing[0][1])}) of "
                                     f"{format_path(key_path(key))}")
    return list(out.values())


def assemble(parts: Sequence[Any], local_rank: int, iteration: int) -> Any:
    """The whole state of one iteration from every rank's part (rank order): each DTensor's
    entry a contiguous CPU tensor of its global shape, every other value from part
    ``local_rank``; no section. Checks the layout (:func:`check_sections`) before assembling."""
    where = f"iteration {iteration}: "
    sections = check_sections([section_of(p) for p in parts], where)
    whole: dict[Path, torch.Tensor] = {}
    for key in sections[0]["tensors"]:
        path = key_path(key)
        pieces = [(lookup(parts[r], path), b, r) for r, b in writers(sections, key, where)]
        whole[path] = assemble_tensor(format_path(path), pieces)
    base = {k: v for k, v in parts[local_rank].items() if k != SECTION_KEY}
    return _rebuild(base, lambda p, v: whole.get(p, _SAME))


def is_sharded(store: "JobStore", iteration: int) -> bool:
    """Whether committed ``iteration`` holds a DTensor state (its rank-0 snapshot has the section
    key). Reads one manifest."""
    if store.kind(iteration) != "snapshot":
        return False
    top = top_level_items(store.manifest(iteration, rank=0).state) or []
    return any(k == SECTION_KEY for k, _ in top)


class _Reads:
    """The range reads of one rank's stream and, once read, where each goes."""

    def __init__(self, stream: "Store", iteration: int) -> None:
        self.stream = stream
        self.manifest = stream.manifest(iteration)
        self.index = {p: i for i, p in leaf_paths(self.manifest.state).items()}
        self.ranges: list[RangeRead] = []
        self.places: list[Callable[[], Any]] = []

    def entry(self, path: Path, what: str) -> Any:
        i = self.index.get(path)
        if i is None or not 0 <= i < len(self.manifest.tensors):
            raise DamagedCheckpointError(f"{what}: the part holds no tensor there")
        return i, self.manifest.tensors[i]

    def run(self) -> int:
        """Read every queued span; the bytes read from the log (chunks, whole)."""
        engine = self.stream.engine
        return engine.read(lambda: read_ranges(engine.state_reader(), self.manifest, self.ranges))


def _plan_shard(reads: _Reads, path: Path, saved: dict, dst: torch.Tensor, live: dict,
                what: str) -> None:
    """Queue the read of the part of stored shard ``saved`` (in ``reads``' stream) that overlaps
    the live box ``live`` of ``dst`` (its local tensor): the smallest byte span of the stored
    shard holding the overlap, read into scratch, then copied into ``dst``."""
    common = meet((tuple(saved["offsets"]), tuple(saved["local"])),
                  (tuple(live["offsets"]), tuple(live["local"])))
    if common is None:
        return
    i, e = reads.entry(path, what)
    dtype = TORCH_DTYPES.get(e.dtype) if e.lib == "torch" else None
    if dtype is None or list(e.shape) != list(saved["local"]):
        raise DamagedCheckpointError(f"{what}: the stored shard is {e.lib} {e.dtype}{list(e.shape)}, "
                                     f"not a torch tensor of its box's shape {saved['local']}")
    if dtype != dst.dtype:
        raise TargetMismatchError(f"{what}: the stored tensor is {e.dtype}; the tensor to load "
                                  f"into is {str(dst.dtype).removeprefix('torch.')}")
    lo = [o - so for o, so in zip(common[0], saved["offsets"])]
    first, stop, strides = box_span([int(n) for n in saved["local"]], lo, common[1])
    scratch = torch.empty(stop - first, dtype=dtype)
    item = dtype.itemsize
    reads.ranges.append(RangeRead(i, first * item, stop * item,
                                  memoryview(scratch.view(torch.uint8).numpy())))  # type: ignore[arg-type]
    into = region(dst, [o - lo_ for o, lo_ in zip(common[0], live["offsets"])], common[1])
    reads.places.append(lambda: into.copy_(scratch.as_strided(common[1], strides)))


def _plain(reads: _Reads, skip: set[Path]) -> Callable[[], Any]:
    """Queue the read of every stored tensor of ``reads``' part except those at ``skip`` (the
    shards); returns what builds the part's state (None at ``skip``) once they are read."""
    fresh: dict[int, Any] = {}
    entries = {}
    for i, p in leaf_paths(reads.manifest.state).items():
        if p in skip or not 0 <= i < len(reads.manifest.tensors):
            continue
        e = entries[i] = reads.manifest.tensors[i]
        fresh[i], view = allocate(e)
        reads.ranges.append(RangeRead(i, 0, e.nbytes, view))

    def leaf(i: int, p: Path) -> Any:
        if p in skip:
            return None
        if i not in fresh:
            raise DamagedCheckpointError(f"{format_path(p)}: tensor index {i} unknown")
        return finish(entries[i], fresh[i])
    return lambda: unflatten(reads.manifest.state, leaf)


def load_into(store: "JobStore", iteration: int, into: Any,
              keys: Sequence[Any] | None = None) -> tuple[Any, dict[int, int]]:
    """The state of DTensor iteration ``iteration`` loaded into ``into`` (shaped like the saved
    state; its DTensors and plain tensors at the paths of saved DTensors are filled with their
    boxes, the whole tensor for a plain one), and the bytes read per rank stream. Every other
    value comes from this process's rank's part (rank 0's for a reader, or a rank beyond the
    saved world), read whole, its tensors copied into ``into``'s as :meth:`Store.load` does.
    Every shard target is checked (global shape, dtype) before any byte is read, every other
    tensor target before any is written: TargetMismatchError.
    ``keys``: only these top-level keys (NotFoundError for one the state lacks)."""
    g = store.global_commit(iteration)
    world = g.world_size
    where = f"{store.path}: iteration {iteration}: "
    reads = [_Reads(store.stream(iteration, r), iteration) for r in range(world)]
    sections = check_sections([section_of(store.load_record(iteration, [SECTION_KEY], rank=r))
                               for r in range(world)], where)
    mine = store.rank if store.rank is not None and store.rank < world else 0
    shard_paths = {key_path(k): k for k in sections[0]["tensors"]}
    targets = [(p, v) for p, v in values(into) if p in shard_paths and isinstance(v, torch.Tensor)]
    for path, t in dtensors(into):
        if path not in shard_paths:
            raise TargetMismatchError(f"{where}{format_path(path)}: the iteration holds no sharded "
                                      "tensor there for the DTensor given to load into")
    if keys is not None:
        targets = [(p, t) for p, t in targets if p and p[0] in keys]
    for path, t in targets:
        what = f"{where}{format_path(path)}"
        key = shard_paths[path]
        shape = list(sections[0]["tensors"][key]["shape"])
        if list(t.shape) != shape:
            raise TargetMismatchError(f"{what}: the stored tensor's global shape is {shape}; the "
                                      f"tensor given to load into is {list(t.shape)}")
        if is_dtensor(t):
            live, dst = box_of(t), local(t)
        else:
            live, dst = {"offsets": [0] * len(shape), "local": shape}, t.detach()
        for r, saved in writers(sections, key, where):
            _plan_shard(reads[r], path, saved, dst, live, what)
    build = _plain(reads[mine], set(shard_paths))
    counts = {r: reads[r].run() for r in range(world) if reads[r].ranges}
    with torch.no_grad():
        for rd in reads:
            for place in rd.places:
                place()
    state = select_keys({k: v for k, v in build().items() if k != SECTION_KEY}, keys, iteration)
    state = copy_into(state, into)
    filled = dict(targets)
    return _rebuild(state, lambda p, v: filled[p] if p in filled else _SAME), counts
