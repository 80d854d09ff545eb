"""What runs `nanoqwen ladder`: the rungs one after another, workers sized to the model, the report (and
`ladder merge` of shards' reports), and what a run took of the machine."""
