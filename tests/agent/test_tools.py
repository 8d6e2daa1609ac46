"""Tools a model may call: schemas from signatures and docstrings, exact built-ins, and calls
that come back as an answer the model reads however they go wrong (never an exception)."""

from __future__ import annotations

import time

import pytest

from opd.agent.builtin_tools import calculator, python
from opd.agent.config import AgentConfig, ToolSpec
from opd.agent.sandbox import SandboxLimits, call_function
from opd.agent.tools import Tool, Toolbox, ToolOutcome, build_toolbox, resolve

USER_TOOLS = '''
def lookup(city: str, metric: bool = True) -> str:
    """Look up the weather of a city.

    Args:
        city: The city's name.
        metric: Celsius when true, else Fahrenheit.
    """
    print("looking up", city)
    return {"city": city, "temp": 21 if metric else 70}


def fail(reason: str) -> str:
    """Raise an error.

    Args:
        reason: What the error says.
    """
    raise ValueError(reason)


def hang() -> str:
    """Never answer."""
    while True:
        pass


def flood() -> str:
    """Print ten megabytes."""
    print("x" * 10_000_000)
    return "done"


def undocumented(x):
    return x
'''


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "mytools.py").write_text(USER_TOOLS)
    specs = [ToolSpec("calculator"), ToolSpec("python"), ToolSpec("mytools.py:lookup", name="weather"),
             *(ToolSpec(f"mytools.py:{f}") for f in ("fail", "hang", "flood"))]
    cfg = AgentConfig(tools=specs, timeout_s=1.0, memory_mb=256, max_output_chars=200, workers=4)
    return build_toolbox(cfg, base_dir=folder)


def test_builtin_schemas_come_from_their_docstrings():
    calc = resolve(ToolSpec("calculator"))
    fn = calc.schema["function"]
    assert calc.schema["type"] == "function" and fn["name"] == "calculator" and "exactly" in fn["description"]
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    assert fn["parameters"]["required"] == ["expression"]
    assert calc.ref.endswith("agent/builtin_tools.py:calculator") and calc.ref.startswith("/")
    py = resolve(ToolSpec("python")).schema["function"]
    assert py["name"] == "python" and list(py["parameters"]["properties"]) == ["code"]


def test_a_user_function_in_a_file_resolves_relative_to_the_config(box, tmp_path):
    tool = box.tools["weather"]
    assert tool.ref.startswith("/") and tool.ref.endswith("mytools.py:lookup")
    params = tool.schema["function"]["parameters"]
    assert tool.schema["function"]["name"] == "weather"          # the spec's name, not the function's
    assert params["properties"]["city"] == {"type": "string", "description": "The city's name."}
    assert params["properties"]["metric"]["type"] == "boolean" and params["required"] == ["city"]
    assert box.names == ["calculator", "python", "weather", "fail", "hang", "flood"]
    assert [s["function"]["name"] for s in box.schemas()] == box.names


@pytest.mark.parametrize("function, why", [
    ("no_colon", "expected 'module:function'"),
    ("missing.py:f", "no file"),
    ("mytools.py:nope", "has no function nope"),
    ("mytools.py:undocumented", "cannot describe undocumented"),
    ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
])
def test_a_tool_that_cannot_be_called_is_a_value_error_naming_its_spec(function, why, tmp_path):
    (tmp_path / "mytools.py").write_text(USER_TOOLS)
    with pytest.raises(ValueError, match=why) as e:
        resolve(ToolSpec(function), tmp_path)
    assert function in str(e.value)


def test_calculator_is_exact():
    assert calculator("123456789123 * 987654321987") == str(123456789123 * 987654321987)
    assert calculator("2 ** 200 + 1") == str(2 ** 200 + 1)
    assert calculator("(2 ** 100 - 1) // 3 % 1000") == str((2 ** 100 - 1) // 3 % 1000)
    assert calculator("10 / 2") == "5" and calculator("-1 / 8") == "-0.125" and calculator("0.1 + 0.2") == "0.3"
    assert calculator("1 / 3").startswith("0.3333333333") and calculator("-(3 - 5) ** 3") == "8"
    assert len(calculator("9 ** 10000")) == 9543                  # past str(int)'s 4300-digit limit


@pytest.mark.parametrize("expression, why", [
    ("1 / 0", "division by zero"), ("2 ** 10 ** 9", "more than 10000 digits"), ("x + 1", "names"),
    ("__import__('os')", "not allowed"), ("2 ^ 3", "write \\*\\*"), ("(1 + 2", "not an arithmetic expression"),
    ("2 ** 0.5", "integer exponents"),
])
def test_calculator_refuses_with_a_short_reason(expression, why):
    with pytest.raises(ValueError, match=why):
        calculator(expression)


def test_python_tool_returns_what_it_printed(box):
    assert python("print(6 * 7)") == "42\n"
    assert box.call("python", {"code": "import math\nprint(math.factorial(20))"}) == \
        ToolOutcome(True, "2432902008176640000\n")
    out = box.call("python", {"code": "print('before')\n1 / 0"})
    assert out == ToolOutcome(False, "error: ZeroDivisionError: division by zero\nbefore\n")


def test_a_call_answers_printed_output_then_the_value_as_json(box):
    assert box.call("calculator", '{"expression": "2 ** 64"}') == ToolOutcome(True, "18446744073709551616")
    assert box.call("weather", {"city": "Oslo"}) == ToolOutcome(True, 'looking up Oslo\n{"city": "Oslo", "temp": 21}')


@pytest.mark.parametrize("name, arguments, says", [
    ("search", {"q": "x"}, "unknown tool 'search'; the tools are: calculator, python"),
    ("calculator", '["1 + 1"]', "must be a JSON object, not an array"),
    ("calculator", "{'expression': 1}", "not valid JSON"),
    ("calculator", 7, "must be a JSON object, not a number"),
    ("calculator", {}, "missing the argument 'expression'"),
    ("calculator", {"expression": "1", "digits": 3}, "no argument 'digits'"),
    ("calculator", {"expression": "1 / 0"}, "ValueError: division by zero"),
    ("fail", {"reason": "no such city"}, "ValueError: no such city"),
])
def test_a_malformed_or_failing_call_is_an_error_the_model_reads(box, name, arguments, says):
    out = box.call(name, arguments)
    assert not out.ok and out.text.startswith("error: ") and says in out.text, out


def test_a_hang_is_a_timeout_within_the_limit(box):
    t0 = time.monotonic()
    out = box.call("hang", {})
    assert out == ToolOutcome(False, "error: timed out after 1 s") and time.monotonic() - t0 < 3.0


def test_a_flood_of_output_is_cut_and_says_how_much(box):
    out = box.call("flood", {})
    assert out.ok and out.text.startswith("x" * 200 + "...[cut: ")
    assert int(out.text.split("[cut: ")[1].split()[0]) == 10_000_001 + len("done") - 200


def test_call_function_reads_back_a_capped_head_and_reports_a_memory_hog():
    hog = call_function("json:loads", {"s": "[" * 10}, SandboxLimits(timeout_s=2.0))   # a plain module ref
    assert hog.status == "error" and hog.text.startswith("JSONDecodeError")
    big = call_function(resolve(ToolSpec("python")).ref, {"code": "print('y' * 5_000_000)"},
                        SandboxLimits(timeout_s=3.0, memory_mb=256))
    assert big.status == "ok" and len(big.text) <= 300_000 and len(big.text) + big.omitted == 5_000_001
    oom = call_function(resolve(ToolSpec("python")).ref, {"code": "x = bytearray(2 ** 30)"},
                        SandboxLimits(timeout_s=3.0, memory_mb=128))
    assert oom.status == "error" and "out of memory" in oom.text


def test_call_many_runs_at_once_and_keeps_order(box):
    calls = [("hang", {}), ("calculator", {"expression": "6 * 7"}), ("nope", {}),
             ("python", {"code": "print('hi')"}), ("calculator", "not json")]
    t0 = time.monotonic()
    outs = box.call_many(calls)
    assert [o.ok for o in outs] == [False, True, False, True, False]
    assert outs[1].text == "42" and outs[3].text == "hi\n" and "timed out" in outs[0].text
    assert time.monotonic() - t0 < 3.0          # the hang did not hold the others up
    assert box.call_many([]) == []


def test_a_toolbox_of_hand_made_tools_checks_names():
    tool = Tool("t", "json:dumps", {"type": "function", "function": {"name": "t", "parameters": {}}})
    with pytest.raises(ValueError, match="share a name"):
        Toolbox([tool, tool], AgentConfig())
    # no arguments at all (None) is an empty object; the schema took none, the function needs one
    out = Toolbox([tool], AgentConfig()).call("t", None)
    assert not out.ok and "TypeError" in out.text and "obj" in out.text


def test_the_python_tool_runs_under_the_sandbox_limits(box, tmp_path):
    victim = tmp_path / "victim.txt"
    wrote = box.call("python", {"code": f"open({str(victim)!r}, 'w').write('escaped')"})
    assert not wrote.ok and "PermissionError" in wrote.text and not victim.exists()
    net = box.call("python", {"code": "import socket\nsocket.create_connection(('127.0.0.1', 9))"})
    assert not net.ok and "network access refused" in net.text
