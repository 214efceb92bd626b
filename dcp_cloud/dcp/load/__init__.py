"""The load side of the DCP adapter: ``CloudReader``, the plan of a load's ranged reads, their execution
and checks, guessed footer values, reads shared over the group, and the hand-over to the planner."""
