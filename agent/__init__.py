"""Agentic rollouts: tools a model may call, the sandbox they run in, and the multi-turn loop.

    opd.agent.config    AgentConfig (the `agent:` section of opd train and opd rl), ToolSpec
    opd.agent.tools     Toolbox: declared functions, their JSON schemas, calls that never raise
    opd.agent.sandbox   the limited child process that runs tools and code rewards' tests
    opd.agent.calls     tool calls parsed from a turn's text (Hermes / Qwen <tool_call> format)
    opd.agent.chat      observation tokens: a tool message as the chat template renders it
    opd.agent.loop      AgentEngine: generate -> parse -> execute -> append -> continue
"""
