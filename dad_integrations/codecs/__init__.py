"""Codecs: how one unit's gradient is encoded, moved and decoded, below the route registry (`routes`).

* `exact`: exact factors (lossless dAD), one cut and one rebuild over a region of the weight's rows
  (`Whole`, `RowShards`, `Ranges`), and the collectives that move them per region;
* `power_iteration`: the one power iteration every rank route runs, a site's own (rank-dAD) or
  PowerSGD's all-reduced one, over a batch, on whole matrices or row shards;
* `rank`, `rank_allreduce`: the flat rank routes (each rank's own factors all-gathered; PowerSGD's
  ``P`` and ``Q`` all-reduced); `sharded_rank` under FSDP2 and ZeRO; `replicate_rank` on HSDP's
  replicate hop;
* `route_state`: what the rank routes carry between steps (warm starts, error feedback, pending
  state, finiteness, the checkpoint format); `error_feedback` its residual memories;
* `dense`: the dense all-reduce buckets; `wire`: packing; `low_rank`: a site's rank-r reduction,
  by method; `finite`: the finiteness flag.

A new route does not start here: it is one module registered in `routes` (`routes.codec` for a
codec of one's own).
"""
