"""The exchange: running each step's routes in order on every rank.

The flat exchanger of DDP, Horovod and plain torch.distributed (`exchanger`) with its route policy
(`policy`), the step window and worker, the first-step checks (`checks`), and across nodes the
two-level steps (`two_level`, `levels`, `node_hops`). The sharded exchanger FSDP2 and ZeRO share
(`sharded`) with its shard layouts (`routes.layouts`): row blocks (`row_shards`, FSDP2's
``Shard(0)``), flat element ranges (`partitions`, ZeRO's), HSDP's replicate hop (`replicate_hop`)
and ZeRO's partitions across nodes (`node_partitions`)."""
