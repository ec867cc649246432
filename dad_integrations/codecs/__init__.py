"""One codec per representation a unit's gradient can take on the wire (see `router`).

* `exact`: the unit's factors, all-gathered (lossless dAD);
* `rank`: rank-r factors of each rank's gradient, all-gathered (rank-dAD), with warm start;
* `dense`: the dense all-reduce buckets.

Each encodes this rank's local gradient into a payload and decodes the gathered or reduced
payloads into the synchronised gradient; `exchange.Exchanger` runs their collectives in order.
A new representation is a new module here plus its line in `router.route`.
"""
