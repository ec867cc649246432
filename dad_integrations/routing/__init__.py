"""Routing: which representation each weight takes. The pure router (`router`), byte costs
(`costs`), the link and compute models (`link`, `compute_model`, `timing`), route trials on the
job's own steps (`trial`, `sharded_trial`), and the planner's library (`planner`, `plan_time`)."""
