"""Code that runs inside vLLM's worker processes: the weight push for on-policy rollouts.

vLLM mixes this class into its worker when the engine is built with
`LLM(..., worker_extension_cls="opd.rollout.vllm_worker.WeightSync")`; the trainer side
calls its methods with `llm.collective_rpc("load_weights_from_files", args=(paths,))`.

Two facts shape it (verified on CPU, see NOTES.md): tensors inside collective_rpc
arguments arrive as Python lists, so the trainer hands over a path to a safetensors
file instead; and `model.load_weights` directly breaks the CPU backend's repacked
parameters, while `model_runner.reload_weights` goes through vLLM's own loader and
repacks them again.
"""

from __future__ import annotations


class WeightSync:
    """Mixed into vLLM's Worker: `self.model_runner` is the worker's model runner."""

    def load_weights_from_files(self, paths: list[str]) -> int:
        """Replace the model's weights with checkpoint-format (HF names) safetensors files, all
        in one reload (vLLM reloads a model whole), read one tensor at a time: a sharded
        student's sync writes its buckets as files (opd.spine.engine), none held in memory."""
        from safetensors import safe_open

        count = 0

        def weights():
            nonlocal count
            for path in paths:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        count += 1
                        yield name, f.get_tensor(name)
        self.model_runner.reload_weights(weights_iterator=weights())
        return count
