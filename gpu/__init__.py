"""triode.gpu: everything that runs torch — model runner, layers, sampler, worker processes."""
