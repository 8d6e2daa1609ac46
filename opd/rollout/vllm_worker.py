"""Code that runs inside vLLM's worker processes: the weight push for on-policy rollouts.

vLLM mixes this class into its worker when the engine is built with
`LLM(..., worker_extension_cls="opd.rollout.vllm_worker.WeightSync")`; the trainer side
calls its methods with `llm.collective_rpc("load_weights_from_file", args=(path,))`.

Two facts shape it (verified on CPU, see NOTES.md): tensors inside collective_rpc
arguments arrive as Python lists, so the trainer hands over a path to a safetensors
file instead; and `model.load_weights` directly breaks the CPU backend's repacked
parameters, while `model_runner.reload_weights` goes through vLLM's own loader and
repacks them again.
"""

from __future__ import annotations


class WeightSync:
    """Mixed into vLLM's Worker: `self.model_runner` is the worker's model runner."""

    def load_weights_from_file(self, path: str) -> int:
        """Replace the model's weights with a checkpoint-format (HF names) safetensors file."""
        from safetensors.torch import load_file

        state_dict = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(state_dict.items()))
        return len(state_dict)
