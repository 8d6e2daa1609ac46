"""The teacher wire protocol: every message both sides exchange, in one module.

Transport: ZeroMQ. The server binds a ROUTER, each client connects a DEALER. A message is
multipart: one small msgpack header frame (a tagged msgspec Struct below), followed by
zero or more raw tensor frames. Tensors are little-endian, C-contiguous, sent without
copies; the header lists their dtype and shape (`tensors`). Nothing is pickled: the
decoder accepts only the Structs below and the dtypes in DTYPES, and bounds every size
before allocating anything. bf16 travels as a uint16 view tagged "bf16".

Conversation (DEALER -> ROUTER, ROUTER -> DEALER):

    HELLO(version)            -> WELCOME(teacher, fingerprints, limits) | ERROR(BAD_VERSION)
    SCORE(request)            -> TOPK(answer, stats)          (mode "topk")
                              -> CHUNK ... CHUNK DONE          (mode "full", streamed)
                              -> DONE(cached)                  (mode "prefill", 2.6)
                              -> ERROR(code, retryable)        (anything wrong, or BUSY)
    SAMPLE(request)           -> SAMPLES(responses, stats)     (the teacher answers prompts)
                              -> ERROR(code, retryable)
    CREDIT(request, n)           the client may receive n more CHUNKs of that request
    CANCEL(request)           -> ERROR(CANCELLED)
    PING                      -> PONG                          (heartbeats, both ways)

Row convention (the one thing to remember): sequence b has token ids
`ids[offsets[b]:offsets[b+1]]` and a response start `s_b >= 1`. Row i of its answer is
the teacher's distribution for the token at position `s_b + i`, i.e. computed from the
logits at position `s_b + i - 1`; there are `len_b - s_b` rows. Rows of all sequences are
concatenated in order; `row_offsets[b]` is where sequence b's rows start. The sampled
token of row i is `ids[s_b + i]`, and `token_logprob[i]` is the teacher's log-probability
of it. Temperature T is applied by the server before the softmax: log_softmax(logits / T).

Top-k answer tensors, per row r (R rows in total):
    ids            int32 [R, k]   the teacher's k most likely tokens, most likely first
    logprobs       fp32  [R, k]   their log-probabilities (temperature applied)
    tail_logmass   fp32  [R]      log(1 - sum(exp(logprobs))), computed stably; -inf if none
    token_logprob  fp32  [R]      log-probability of the token that stands in the sequence
    lse            fp32  [R]      logsumexp(logits / T) over the vocabulary

Teacher context (`context`): the teacher may see another prompt than the student.
Two more tensors, context_ids int32 [C] and context_offsets int32 [B + 1], give c_b per
sequence; the teacher then scores c_b + ids_b[s_b:] (c_b replaces the prompt ids_b[:s_b];
an empty c_b keeps it). Rows do not change: row i is still the token ids_b[s_b + i], now
computed from the logits at position len(c_b) + i - 1 of the teacher's input.

Given support (`support: "given"`): one more tensor, candidates int32 [R, k], the ids
the client wants per row (e.g. the student's own top k), distinct within a row. The TOPK
answer's ids are those candidates in their order, logprobs their log-probabilities, and
tail_logmass the log-mass of every other id.

Row mask (`rows`): one more tensor, row_mask uint8 [sum over b of len_b - s_b], 0/1,
one entry per response row of every sequence (after the context tensors, before the
candidates). The answer then holds only the rows whose mask is 1, in order: row_offsets
count those, candidates are [their number, k]. The teacher still reads every token (a
multi-turn trajectory's tool observations are context), but answers only the rows trained on.

Prefill (mode "prefill"): sequences the client will send to be scored soon, as the
teacher sees them: prompts (response_starts: their lengths), or prompt + the response so far
(response_starts: where it starts); no context, mask or candidates. A server whose WELCOME says
prompt_cache_tokens > 0 computes and keeps their keys and values (each continuing the longest
it holds of the same sequence), and a later SCORE is computed from the end of the longest held
first tokens of its sequence (with the same s_b) on; the answer is the same up to float
rounding. DONE says how many of their tokens are held (`cached`). A hint: a server may evict
an entry before it is read.

Sample (SAMPLE): the teacher generates. Tensors ids int32 [T] and offsets int32 [B + 1]
are B prompts as the teacher reads them (the client applies the chat template); the answer,
SAMPLES, holds n responses per prompt, response j of prompt b numbered b * n + j, as ids int32
[total] and offsets int32 [B * n + 1], each ending after its first stop id (kept) or at
max_new_tokens (`finish` says which). What a run measures a teacher's pass rate with
(`routing.refresh_every`), and what `opd generate` samples a served teacher with. A WELCOME
whose `modes` lists "sample" answers it; the client sends it to no other.

Full-vocabulary answer: CHUNKs of consecutive rows, `logits` [rows, V] in the requested
dtype (temperature NOT applied to these raw logits; `lse` is of logits / T) and fp32
`lse` [rows] and `token_logprob` [rows], so neither side holds [all rows x V] at once.
"""

from __future__ import annotations

import enum
import math
import warnings
from typing import Literal, Union

import msgspec
import numpy as np
import zmq

PROTOCOL_VERSION = (2, 7)  # major mismatch is refused at HELLO; minor is informational
# What each minor version added, and how an older peer answers it: docs/protocol.md, "Versions".

# Bounds checked before any allocation.
MAX_HEADER_BYTES = 1 << 20        # 1 MiB of msgpack header
MAX_TENSORS = 8                   # tensor frames per message
MAX_TENSOR_BYTES = 1 << 31        # 2 GiB per tensor frame
MAX_DIMS = 4

# Wire dtype tag -> numpy little-endian dtype. bf16 is carried as uint16 bits.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),      # the row mask
}
LOGIT_DTYPES = ("float32", "bfloat16", "float16")  # what a client may ask for in full mode
MAX_CHUNK_BYTES = 256 << 20       # a full-mode CHUNK's rows x V x 4 bytes may not exceed this
DEFAULT_CHUNK_BYTES = 64 << 20    # what clients aim for when the caller gives no chunk_rows


def default_chunk_rows(vocab_size: int, dtype: str) -> int:
    """Rows per CHUNK of ~DEFAULT_CHUNK_BYTES (at most 1024): 110 rows at V=152,064 fp32,
    512 at V=32,768 fp32. A fixed 1024 exceeded MAX_CHUNK_BYTES past V=65,536."""
    item = 2 if dtype in ("bfloat16", "float16") else 4
    return max(1, min(1024, DEFAULT_CHUNK_BYTES // (item * vocab_size), MAX_CHUNK_BYTES // (4 * vocab_size)))


class ErrorCode(str, enum.Enum):
    BAD_VERSION = "BAD_VERSION"        # protocol major version differs
    MALFORMED = "MALFORMED"            # header not decodable, frames missing/extra/wrong size
    UNKNOWN_TYPE = "UNKNOWN_TYPE"      # a header whose message type this server does not know
    BAD_TOKEN = "BAD_TOKEN"            # token id < 0 or >= vocab size
    TOO_LONG = "TOO_LONG"              # a sequence or request beyond the server's limits
    BAD_K = "BAD_K"                    # k < 1 or k > max_k
    BAD_REQUEST = "BAD_REQUEST"        # any other invalid field (temperature <= 0, starts, ...)
    UNSUPPORTED = "UNSUPPORTED"        # valid, but this backend cannot answer it exactly
    BUSY = "BUSY"                      # in-flight token budget full: retry later
    CANCELLED = "CANCELLED"            # the client cancelled the request
    SHUTTING_DOWN = "SHUTTING_DOWN"    # the server is draining; go to another replica
    INTERNAL = "INTERNAL"              # a bug or an out-of-memory in the backend


RETRYABLE = {ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN, ErrorCode.INTERNAL}


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    dtype: str
    shape: tuple[int, ...]


class _Msg(msgspec.Struct, tag_field="type", kw_only=True):
    tensors: list[TensorSpec] = []


class Hello(_Msg, tag="hello"):
    version: tuple[int, int]
    client: str = ""


class Welcome(_Msg, tag="welcome"):
    version: tuple[int, int]
    teacher: str                        # human name of this teacher ("math")
    model_id: str                       # path or hub id it was loaded from
    model_fingerprint: str
    tokenizer_fingerprint: str
    vocab_size: int                     # rows of the answer's vocabulary (the LM head's)
    max_k: int
    modes: list[str]                    # subset of ("topk", "full", "sample")
    dtypes: list[str]                   # logit dtypes available in full mode
    max_tokens_per_request: int
    max_inflight_tokens: int
    heartbeat_s: float
    backend: str                        # "hf" or "vllm"
    supports_temperature: bool = True   # temperature != 1 answered exactly
    exact_lse: bool = True              # False: `lse` in answers is NaN (vLLM does not expose it)
    max_positions: int = 0              # longest sequence (prompt + response) it scores; 0: not said
    prompt_cache_tokens: int = 0        # > 0: SCORE mode "prefill" keeps up to this many prompt tokens


class Score(_Msg, tag="score"):
    """tensors: ids int32 [total_tokens], offsets int32 [B + 1]; then, in this order, when
    asked: context_ids int32 [C] and context_offsets int32 [B + 1] (context), row_mask uint8
    [response rows] (rows), candidates int32 [R, k] (support "given"; R: the mask's ones)."""
    request_id: int
    mode: Literal["topk", "full", "prefill"]
    response_starts: list[int]          # [B], each >= 1 (prefill: the lengths)
    k: int = 0                          # topk mode
    temperature: float = 1.0
    dtype: str = "float32"              # full mode: logits dtype on the wire
    chunk_rows: int = 1024              # full mode: rows per CHUNK (<= MAX_CHUNK_BYTES / (4 V))
    window: int = 4                     # full mode: CHUNKs the server may send before a CREDIT
    vocab_limit: int = 0                # > 0: score over the first vocab_limit columns only
    context: bool = False               # + context_ids int32 [C], context_offsets int32 [B + 1]
    support: Literal["teacher", "given"] = "teacher"   # "given": + candidates int32 [R, k]
    rows: bool = False                  # + row_mask uint8 [response rows]: answer its 1s only

    def tensor_names(self) -> list[str]:
        """The names of the tensors this SCORE carries, in their order on the wire."""
        return ["ids", "offsets", *(["context_ids", "context_offsets"] if self.context else []),
                *(["row_mask"] if self.rows else []), *(["candidates"] if self.support == "given" else [])]


class TopK(_Msg, tag="topk"):
    """tensors: ids int32 [R, k], logprobs fp32 [R, k], tail_logmass fp32 [R],
    token_logprob fp32 [R], lse fp32 [R]. The last message of its request: `stats` is
    what a DONE would say (one message less per request at the same bytes)."""
    request_id: int
    row_offsets: list[int]              # [B + 1]
    stats: "Done"


class Chunk(_Msg, tag="chunk"):
    """tensors: logits <dtype> [rows, V], lse fp32 [rows], token_logprob fp32 [rows]."""
    request_id: int
    row_start: int                      # global row index of the chunk's first row
    row_offsets: list[int]              # [B + 1], repeated in every chunk for convenience


class Done(_Msg, tag="done"):
    request_id: int
    rows: int
    tokens: int
    queue_ms: float
    compute_ms: float
    total_ms: float
    chunks: int = 0
    cached: int = 0                     # prefill: tokens of its prompts the server holds


class Sample(_Msg, tag="sample"):
    """tensors: ids int32 [total prompt tokens], offsets int32 [B + 1]: the prompts as the
    teacher reads them."""
    request_id: int
    n: int = 1                          # responses per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0            # 0: greedy
    top_p: float = 1.0
    seed: int = 0                       # the same request and seed: the same responses (one backend, one machine)
    stop_ids: list[int] = []            # a response ends after the first of these; []: the teacher's own EOS


class Samples(_Msg, tag="samples"):
    """tensors: ids int32 [total response tokens], offsets int32 [B * n + 1]; response j of
    prompt b is number b * n + j."""
    request_id: int
    finish: list[str]                   # [B * n] "stop" (a stop id ended it, kept) | "length"
    stats: "Done"


class Error(_Msg, tag="error"):
    request_id: int                     # -1 when the request id could not be read
    code: ErrorCode
    retryable: bool
    message: str


class Credit(_Msg, tag="credit"):
    request_id: int
    chunks: int


class Cancel(_Msg, tag="cancel"):
    request_id: int


class Ping(_Msg, tag="ping"):
    t: float = 0.0


class Pong(_Msg, tag="pong"):
    t: float = 0.0


Message = Union[Hello, Welcome, Score, TopK, Chunk, Done, Sample, Samples, Error, Credit, Cancel, Ping, Pong]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ProtocolError(Exception):
    """A message that does not follow this protocol. `code` says which ERROR to answer."""

    def __init__(self, code: ErrorCode, message: str, request_id: int = -1):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


def error(request_id: int, code: ErrorCode, message: str) -> Error:
    return Error(request_id=request_id, code=code, retryable=code in RETRYABLE, message=message)


# numpy dtype -> wire tag, for the dtypes that travel as themselves (bf16 goes as uint16 bits).
_TAGS = {dt: tag for tag, dt in DTYPES.items() if tag != "bf16"}


def _wire_array(t) -> tuple[str, np.ndarray]:
    """A torch tensor or numpy array as (wire dtype tag, little-endian C-contiguous ndarray).
    Runs for every tensor of every answer: lookups, not loops (docs/benchmarks.md, the transport)."""
    if not isinstance(t, np.ndarray):  # torch.Tensor
        import torch   # lazy: the client side (opd.teachers, `opd keys`) imports without torch

        if t.requires_grad:
            t = t.detach()
        if not t.is_cpu:
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            return "bf16", t.contiguous().view(torch.int16).numpy().view("<u2")
        t = t.contiguous().numpy()
    tag = _TAGS.get(t.dtype) or _TAGS.get(t.dtype.newbyteorder("<"))  # the second: big-endian input
    if tag is None:
        raise TypeError(f"dtype {t.dtype} cannot travel; use one of {list(DTYPES)}")
    return tag, np.ascontiguousarray(t, dtype=DTYPES[tag])


def encode(msg: _Msg, tensors=()) -> list:
    """Header frame + tensor frames (numpy arrays, zero-copy for zmq's send_multipart(copy=False))."""
    arrays = [_wire_array(t) for t in tensors]
    msg.tensors = [TensorSpec(tag, a.shape) for tag, a in arrays]
    return [_encoder.encode(msg), *[a for _, a in arrays]]


# zmq flags as plain ints: pyzmq's send_multipart builds its IntFlag enums anew for every frame,
# on each side of every answer.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)


def send_frames(sock, frames) -> None:
    """`sock.send_multipart(frames, zmq.NOBLOCK, copy=False)` with plain-int flags. zmq takes a
    multipart message atomically: if the first frame is refused (zmq.Again), none was sent."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _NOBLOCK_MORE if i < last else _NOBLOCK, copy=False)


def _read_request_id(header: bytes) -> int:
    """Best effort: the request id of a header that failed validation, for the ERROR answer."""
    try:
        raw = msgspec.msgpack.decode(header)
        rid = raw.get("request_id", -1) if isinstance(raw, dict) else -1
        return rid if isinstance(rid, int) else -1
    except Exception:
        return -1


def decode(frames) -> tuple[Message, list[np.ndarray]]:
    """Parse a multipart message (without the ROUTER identity frame).

    Returns the typed header and its tensors as read-only numpy views of the frames
    (bf16 tensors come back as uint16; see `to_torch`). Raises ProtocolError on anything
    that does not fit: sizes are checked against the header before any view is made.
    """
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED, "empty message")
    header = bytes(memoryview(frames[0]))
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED, f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        msg = _decoder.decode(header)
    except msgspec.ValidationError as e:
        rid = _read_request_id(header)
        text = str(e)
        code = ErrorCode.UNKNOWN_TYPE if "Invalid value" in text and "`$.type`" in text else ErrorCode.MALFORMED
        raise ProtocolError(code, f"bad header: {text}", rid) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(ErrorCode.MALFORMED, f"header is not msgpack: {e}") from None
    rid = getattr(msg, "request_id", -1)
    specs = msg.tensors
    if len(specs) > MAX_TENSORS or len(frames) - 1 != len(specs):
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"header declares {len(specs)} tensors but {len(frames) - 1} frames came", rid)
    arrays = []
    for spec, frame in zip(specs, frames[1:]):
        dt = DTYPES.get(spec.dtype)
        if dt is None:
            raise ProtocolError(ErrorCode.MALFORMED, f"dtype {spec.dtype!r} not in {list(DTYPES)}", rid)
        if len(spec.shape) > MAX_DIMS or any(s < 0 for s in spec.shape):
            raise ProtocolError(ErrorCode.MALFORMED, f"bad shape {spec.shape}", rid)
        nbytes = math.prod(spec.shape) * dt.itemsize  # Python ints: a huge shape cannot wrap to 0
        if nbytes > MAX_TENSOR_BYTES:
            raise ProtocolError(ErrorCode.MALFORMED, f"tensor of {nbytes} bytes exceeds {MAX_TENSOR_BYTES}", rid)
        buf = memoryview(frame)
        if buf.nbytes != nbytes:
            raise ProtocolError(ErrorCode.MALFORMED,
                                f"frame has {buf.nbytes} bytes, header says {spec.shape} {spec.dtype} = {nbytes}", rid)
        arrays.append(np.frombuffer(buf, dtype=dt).reshape(spec.shape))
    return msg, arrays


def to_torch(array: np.ndarray, tag: str | None = None):
    """A received array as a torch tensor (bf16 restored from its uint16 bits), zero-copy.

    The tensor shares the memory of the ZeroMQ frame it arrived in and keeps that frame
    alive. numpy marks such buffers read-only, but after a receive the frame's memory
    belongs to this process alone, so writing to the tensor is safe; copying every answer
    here was a large share of the client's time (docs/benchmarks.md, the transport).
    """
    import torch   # lazy, as in _wire_array

    if array.flags.writeable:  # a received frame usually is; catch_warnings is slow for every tensor
        t = torch.from_numpy(array)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(array)
    if tag == "bf16" or array.dtype == np.dtype("<u2"):
        return t.view(torch.bfloat16)
    return t
