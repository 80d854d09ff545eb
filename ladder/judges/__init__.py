"""How a rung decides: the one tolerance table, the comparison against a noise floor, the graph rung's
token judge and its bounds, and the references' results kept per machine."""
