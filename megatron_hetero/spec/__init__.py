"""What a run is, before any process or import of torch: layouts, the rules of what can run, model sizes."""
