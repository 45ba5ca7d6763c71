"""P1's execution: the model runner (``runner.py``) turns a scheduled step into one forward
pass over the paged KV pool (``paged_attention.py``, the attention backends in
``attn_backends.py``, the step's metadata in ``attn_metadata.py``/``step_builder.py``), then
samples (``sampler.py``); decode CUDA graphs, tensor parallelism, device sizing and the
start-up self-check live here too. It reads the scheduler's output types
(``engine/scheduling/sched_output.py``) and never schedules.
"""
