"""What a teacher's WELCOME must say for a teacher spec of a merge config (opd train's
merge.teachers, opd rl's teachers: routing's TeacherSpec, read by field) before a run sends it
anything. Light on purpose: `opd route check` and the configs' checks import it without torch."""

from __future__ import annotations


def _needed_mode(spec) -> str:
    # sampled-token reverse KL only needs the teacher's log-prob of the sampled token,
    # which a top-k answer carries (token_logprob).
    # The student's top k is a top-k request whose candidates the student gives (support "given").
    return "topk" if spec.mode in ("sampled", "student_topk") else spec.mode


def check_welcome(spec, welcome, student_tokenizer_fingerprint: str, at: str | None = None,
                  teacher_tokenizer_fingerprint: str | None = None) -> list[str]:
    """Problems of one teacher's WELCOME against its spec and the student's tokenizer.
    at: where it answered, when not spec.address (a pool of replicas). A `tokenizer: cross`
    teacher's must be the fingerprint of its cross.tokenizer_path (teacher_tokenizer_fingerprint;
    None: not checked here, the light `opd route check`)."""
    where = f"teacher {spec.name!r} at {at or spec.address}"
    problems = []
    if getattr(spec, "tokenizer", "same") == "cross":
        if teacher_tokenizer_fingerprint is not None and welcome.tokenizer_fingerprint != teacher_tokenizer_fingerprint:
            problems.append(f"{where}: tokenizer fingerprint {welcome.tokenizer_fingerprint} differs from its "
                            f"cross.tokenizer_path's {teacher_tokenizer_fingerprint} ({spec.cross.tokenizer_path}): "
                            f"the response would be retokenized with another tokenizer than the server reads "
                            f"(the server loaded {welcome.model_id})")
    elif welcome.tokenizer_fingerprint != student_tokenizer_fingerprint:
        problems.append(f"{where}: tokenizer fingerprint {welcome.tokenizer_fingerprint} differs from the "
                        f"student's {student_tokenizer_fingerprint}; a teacher must use the student's tokenizer "
                        f"(vocabulary, special tokens and chat template; the server loaded {welcome.model_id}), "
                        f"or be declared `tokenizer: cross` (docs/teachers.md)")
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
