"""`opd generate`: a teacher's samples as training data (sequence-level distillation).

The teacher answers each prompt n times (a local model with the hf or vLLM engine, or an
OpenAI-compatible HTTP endpoint); the responses are filtered by the domain verifier
(rejection sampling) and deduplicated, and written as `opd sft` reads them, with a card.
config.py holds the typed config, sample.py the work, cli.py the command.
"""
