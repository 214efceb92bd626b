"""Real ``torch.distributed`` ranks for tests: spawned gloo process groups, one-shot (:mod:`.multirank`) or
kept between calls (:mod:`.worlds`), over the process plumbing they share (:mod:`.rankprocs`)."""
