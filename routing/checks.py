"""Before any compute: every teacher of a merge is reachable, speaks the student's tokenizer,
and can answer the way its spec asks (mode, k).

A token id means nothing across tokenizers: a teacher with another tokenizer would score
the student's ids as different text and the run would train on noise without an error.
So a fingerprint mismatch is refused, as is a teacher that does not answer in time. All
teachers are checked, then every problem is reported together, each naming the teacher,
its address and what differs.
"""

from __future__ import annotations

from opd.routing.config import TeacherSpec
from opd.teachers.client import TeacherClient


class TeacherCheckError(RuntimeError):
    """One or more teachers of the merge cannot be used; the message lists every problem."""


def _needed_mode(spec: TeacherSpec) -> str:
    # sampled-token reverse KL only needs the teacher's log-prob of the sampled token,
    # which a top-k answer carries (token_logprob).
    # The student's top k is a top-k request whose candidates the student gives (protocol 2.4).
    return "topk" if spec.mode in ("sampled", "student_topk") else spec.mode


def check_welcome(spec: TeacherSpec, welcome, student_tokenizer_fingerprint: str, at: str | None = None) -> list[str]:
    """Problems of one teacher's WELCOME against its spec and the student's tokenizer.
    at: where it answered, when not spec.address (a pool of replicas)."""
    where = f"teacher {spec.name!r} at {at or spec.address}"
    problems = []
    if welcome.tokenizer_fingerprint != student_tokenizer_fingerprint:
        problems.append(f"{where}: tokenizer fingerprint {welcome.tokenizer_fingerprint} differs from the "
                        f"student's {student_tokenizer_fingerprint}; a teacher must use the student's tokenizer "
                        f"(vocabulary, special tokens and chat template; the server loaded {welcome.model_id})")
    mode = _needed_mode(spec)
    if mode not in welcome.modes:
        problems.append(f"{where}: mode {spec.mode!r} needs {mode!r}, the server offers {list(welcome.modes)}")
    if mode == "topk" and spec.k > welcome.max_k:
        problems.append(f"{where}: k={spec.k} exceeds the server's max_k={welcome.max_k} "
                        f"(lower `k` or start the server with --max-k {spec.k})")
    needs = [what for what, on in (("a teacher context", spec.context is not None),
                                   ("the student's candidate ids (mode student_topk)", spec.mode == "student_topk"))
             if on]
    if needs and tuple(welcome.version) < (2, 4):
        problems.append(f"{where}: {' and '.join(needs)} need a server of protocol 2.4, it speaks "
                        f"{tuple(welcome.version)}: upgrade the teacher server")
    # A vLLM teacher cannot score at another temperature: every request would come back
    # UNSUPPORTED, the first one at the step-0 evaluation after the student has loaded.
    if spec.temperature != 1.0 and not getattr(welcome, "supports_temperature", True):
        problems.append(f"{where}: temperature {spec.temperature} is not answered by its {welcome.backend} "
                        f"backend (it scores at temperature 1 only); set temperature 1 or serve the teacher "
                        f"with --backend hf")
    return problems


def check_teachers(teachers: list[TeacherSpec], student_tokenizer_fingerprint: str, *, timeout_s: float = 10.0,
                   client_key: str | None = None, client_factory=None) -> dict:
    """Connect to every teacher; return {name: Welcome} or raise TeacherCheckError listing every problem.

    client_key: the client's CURVE secret key file, needed for teachers with `curve_server_key`.
    client_factory(address, timeout_s, curve) -> client with .info() and .close(); the default is
    opd.teachers.client.TeacherClient.
    """
    if client_factory is None:
        def client_factory(address, timeout_s, curve):
            return TeacherClient(address, timeout_s=timeout_s, retries=0, curve=curve)

    welcomes, problems = {}, []
    if not teachers:
        raise TeacherCheckError("no teachers to check")
    for spec in teachers:
        where = f"teacher {spec.name!r} at {spec.address}"
        curve = None
        if spec.curve_server_key:
            if not client_key:
                problems.append(f"{where}: the teacher uses CURVE ({spec.curve_server_key}) but no client "
                                f"secret key was given")
                continue
            curve = (client_key, spec.curve_server_key)
        client = None
        try:
            client = client_factory(spec.address, timeout_s, curve)
            welcome = client.info()
        except Exception as e:  # unreachable, timed out, refused: all the same to the user
            problems.append(f"{where}: not reachable within {timeout_s:g}s ({type(e).__name__}: {e}); "
                            f"is `opd serve-teacher` running there?")
            continue
        finally:
            if client is not None:
                client.close()
        problems += check_welcome(spec, welcome, student_tokenizer_fingerprint)
        welcomes[spec.name] = welcome
    if problems:
        raise TeacherCheckError("refusing to start, teacher check failed:\n  " + "\n  ".join(problems))
    return welcomes
