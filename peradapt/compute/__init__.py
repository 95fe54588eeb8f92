"""Client-side compute on the shared model: the trainer (`trainer`: minibatch SGD jobs and inference), several
clients' SGD at once (`concurrent`), DP-SGD (`privacy`) and the task's metric (`metrics`). Methods, distillation
and evaluation build on it; it knows nothing of rounds or run directories but the client store it charges DP to."""
