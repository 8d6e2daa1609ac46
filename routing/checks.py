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
from opd.teachers.welcome import check_welcome


class TeacherCheckError(RuntimeError):
    """One or more teachers of the merge cannot be used; the message lists every problem."""


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
