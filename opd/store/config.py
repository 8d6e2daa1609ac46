"""Configs of the teacher logit store: `opd store`'s (StoreConfig) and the train config's `store:`
section (StoredSource). Torch-free: the train config imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from opd.config import field
from opd.routing.config import TeacherClientSettings, TeacherSpec
from opd.spine.config import DType, ModelConfig

# The address a stored teacher's spec carries in a train config with `store:`: nothing listens
# there and nothing connects to it (the card shows it beside the store's path).
STORE_ADDRESS = "inproc://opd-store"


@dataclass(frozen=True)
class StoreStudent:
    path: str = field(help="the student's model directory: its tokenizer encodes the sequences (the teacher must "
                           "share it), and with sequences.prompts it samples them")
    dtype: DType = field("float32", help="sequences.prompts: the weights' dtype while sampling")
    device: str = field("auto", help="sequences.prompts: torch device (auto: cuda when available)")

    def model(self) -> ModelConfig:
        return ModelConfig(path=self.path, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class StoreTeacher:
    address: str | None = field(None, help="a running `opd serve-teacher`, e.g. tcp://127.0.0.1:5601 (or give "
                                           "`model`)")
    model: str | None = field(None, help="instead of `address`: a model directory that `opd store` serves itself "
                                         "for the run (a subprocess, stopped at the end)")
    backend: Literal["hf", "vllm"] = field("hf", help="with `model`: the server's backend")
    serve_args: list[str] = field(default_factory=list, help="with `model`: extra `opd serve-teacher` arguments, "
                                                             "e.g. ['--device', 'cuda', '--dtype', 'bfloat16']")
    name: str = field("teacher", help="the teacher's name (the store's manifest, the training card)")
    startup_timeout_s: float = field(600.0, help="with `model`: seconds the server may take to start", min=1.0)
    curve_server_key: str | None = field(None, help="server public key file when the teacher uses CURVE "
                                                    "(teacher_client.curve_secret_key: the client's)")

    def __post_init__(self):
        if (self.address is None) == (self.model is None):
            raise ValueError("teacher: give `address` (a running opd serve-teacher) or `model` (a model directory "
                             "opd store serves itself), one of them")
        if self.address is not None and not self.address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"teacher.address {self.address!r} needs its transport, e.g. tcp://127.0.0.1:5601")


@dataclass(frozen=True)
class StoreSequences:
    # --- one of: fixed sequences, or prompts the student samples
    path: str | None = field(None, help="JSONL of prompt/response rows (or `messages` ending in the assistant's "
                                        "answer): what `opd generate` writes and `opd sft` reads")
    prompts: str | None = field(None, help="instead of `path`: JSONL prompts the student answers once with its "
                                           "rollout engine (its own rollouts, Lightning-OPD style)")
    # --- sampling (with `prompts`)
    n: int = field(1, help="prompts: responses sampled per prompt", min=1)
    temperature: float = field(1.0, help="prompts: sampling temperature", min=0.0)
    top_p: float = field(1.0, help="prompts: nucleus sampling threshold", min=0.0, max=1.0)
    max_new_tokens: int = field(256, help="prompts: length limit of a response", min=1)
    engine: Literal["hf", "vllm"] = field("hf", help="prompts: the student's rollout engine (opd/rollout)")
    seed: int = field(0, help="prompts: sampling seed (each shard's own numbers, so a resumed store samples "
                              "what an uninterrupted one would)")
    # --- both
    max_sequences: int | None = field(None, help="only the first N sequences (JSONL rows, or prompts x n)", min=1)

    def __post_init__(self):
        if (self.path is None) == (self.prompts is None):
            raise ValueError("sequences: give `path` (prompt/response JSONL) or `prompts` (the student samples "
                             "them), one of them")


@dataclass(frozen=True)
class StoreConfig:
    # --- core
    student: StoreStudent = field(help="the student: its tokenizer encodes the sequences, and with "
                                       "sequences.prompts it samples them")
    teacher: StoreTeacher = field(help="who scores: a running teacher server, or a model served for the run")
    sequences: StoreSequences = field(help="what is scored")
    out: str = field(help="the store's directory (manifest.json and shard_NNNNNN.npz); an unfinished store there "
                          "is resumed")
    # --- what is stored
    k: int = field(32, help="top-k ids and log-probs kept per response token (train with the same k)", min=1)
    temperature: float = field(1.0, help="the teacher's temperature (train with the same)", min=1e-3)
    shard_size: int = field(256, help="sequences per shard file (a crash loses at most the shard being written)",
                            min=1)
    batch_size: int = field(16, help="sequences per request to the teacher (several in flight)", min=1)
    teacher_client: TeacherClientSettings = field(default_factory=TeacherClientSettings,
                                                  help="timeouts and retries towards the teacher server")

    def __post_init__(self):
        n = self.sequences.n
        if self.sequences.prompts is not None and self.shard_size % n:
            raise ValueError(f"shard_size {self.shard_size} is no multiple of sequences.n {n}: a prompt's responses "
                             f"are sampled together, in one shard")


@dataclass(frozen=True)
class StoredSource:
    """A train config's `store:`: the teacher and the data of the run are a store's."""
    path: str = field(help="the store's directory, written by `opd store` (its manifest.json)")
    k: int = field(32, help="top-k size the loss uses; must equal the store's k", min=1)
    temperature: float = field(1.0, help="must equal the temperature the store was scored at", min=1e-3)
    beta: float = field(0.0, help="0 forward KL(teacher||student), 1 reverse KL(student||teacher), between: "
                                  "generalized JSD", min=0.0, max=1.0)
    scale_by_t2: bool = field(False, help="multiply the loss by temperature^2")
    shuffle: bool = field(True, help="each epoch, shards in a seeded random order and each shard's sequences "
                                     "shuffled (run.seed); false: the store's order")

    def teacher_spec(self, name: str):
        """The merge.teachers entry the store stands for (routing's TeacherSpec: mode topk)."""
        return TeacherSpec(name=name, address=STORE_ADDRESS, mode="topk", k=self.k, temperature=self.temperature,
                           beta=self.beta, scale_by_t2=self.scale_by_t2)
