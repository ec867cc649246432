"""The built-in routes' names: the one place their strings are written.

The layouts branch on these four (an exchanger starts each one its own way); everything else about
a route, its properties, collectives and bytes, is read from its `routes.registry.RouteSpec`. A
route of your own needs no line here: nothing outside its module names it.
"""
DENSE = "dense"
EXACT = "exact"
RANK = "rank"                        # rank-dAD: each rank's own rank-r factors, all-gathered
RANK_ALLREDUCE = "rank_allreduce"    # PowerSGD's all-reduced P and Q
BUILT_IN = (EXACT, RANK, RANK_ALLREDUCE, DENSE)
