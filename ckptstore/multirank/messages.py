"""Messages of the global two-phase commit between ranks. Pure codecs, no I/O, no pickle.

These bytes travel between the ranks of one job over torch.distributed (as uint8 tensors); they
are never stored. Every rank sends one *vote* per commit round; the coordinator answers with one
*outcome*. In DCP's commit variant (format-spec/format.md §22.6) a PREPARED vote travels as the
hex string of these bytes inside a DCP WriteResult, and DCP's ``finish`` (no outcome message)
reports the decision.

Vote::

    0   1   status      1 = prepared (local commits follow), 2 = nothing to commit, 0 = failed
    1   4   count       u32: local commits (status 1) or message bytes (status 0)
    5   ... status 1: count x (commit_seq u64, commit_offset u64, COMMIT payload 96 bytes)
            status 0: count bytes of UTF-8: what failed on that rank

Outcome::

    0   1   code        1 = committed, 0 = aborted, 2 = unknown (written, then superseded)
    1   1   reason      0 none, 1 a rank failed, 2 ranks disagree, 3 stale writer,
                        4 the global log failed
    2   ... UTF-8 message
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from ..errors import FormatError
from ..format.commit import COMMIT_SIZE, decode_commit, encode_commit
from ..format.job import RankCommit

_HEAD = struct.Struct("<BI")
_LOC = struct.Struct("<QQ")
#: longest failure message a vote carries (bytes)
MAX_MESSAGE = 2048


class VoteStatus(enum.IntEnum):
    FAILED = 0
    PREPARED = 1
    EMPTY = 2


class OutcomeCode(enum.IntEnum):
    ABORTED = 0
    COMMITTED = 1
    UNKNOWN = 2


class Reason(enum.IntEnum):
    NONE = 0
    RANK_FAILED = 1
    MISMATCH = 2
    STALE = 3
    GLOBAL_LOG = 4


@dataclass(frozen=True)
class Vote:
    status: VoteStatus
    commits: tuple[RankCommit, ...] = ()
    message: str = ""


@dataclass(frozen=True)
class Outcome:
    code: OutcomeCode
    reason: Reason = Reason.NONE
    message: str = ""


def encode_vote(v: Vote) -> bytes:
    if v.status == VoteStatus.PREPARED:
        body = b"".join(_LOC.pack(c.commit_seq, c.commit_offset) + encode_commit(c.commit)
                        for c in v.commits)
        return _HEAD.pack(v.status, len(v.commits)) + body
    text = v.message.encode("utf-8", "replace")[:MAX_MESSAGE]
    return _HEAD.pack(v.status, len(text)) + text


def decode_vote(buf: bytes) -> Vote:
    if len(buf) < _HEAD.size:
        raise FormatError(f"vote of {len(buf)} bytes is too short")
    status, count = _HEAD.unpack_from(buf)
    body = buf[_HEAD.size:]
    if status == VoteStatus.PREPARED:
        size = _LOC.size + COMMIT_SIZE
        if len(body) != count * size:
            raise FormatError(f"vote names {count} commits in {len(body)} bytes")
        commits = []
        for i in range(count):
            seq, off = _LOC.unpack_from(body, i * size)
            commits.append(RankCommit(seq, off, decode_commit(body[i * size + _LOC.size:(i + 1) * size])))
        return Vote(VoteStatus.PREPARED, tuple(commits))
    if status in (VoteStatus.FAILED, VoteStatus.EMPTY) and len(body) == count:
        return Vote(VoteStatus(status), (), body.decode("utf-8", "replace"))
    raise FormatError(f"vote has status {status} and {len(body)} bytes for count {count}")


def encode_outcome(o: Outcome) -> bytes:
    return bytes([o.code, o.reason]) + o.message.encode("utf-8", "replace")[:4 * MAX_MESSAGE]


def decode_outcome(buf: bytes) -> Outcome:
    if len(buf) < 2 or buf[0] not in {int(c) for c in OutcomeCode} or \
            buf[1] not in {int(r) for r in Reason}:
        raise FormatError(f"outcome {buf[:2]!r} is not valid")
    return Outcome(OutcomeCode(buf[0]), Reason(buf[1]), buf[2:].decode("utf-8", "replace"))
