"""One rank's step at world size W, predicted in one process: sharded.predict_sharded is the entry point;
ddp and ddp_dryrun (DDP's buckets), fsdp2, tp (tensor parallelism), rankstate (what one rank counts),
realranks (the measured twin on real gloo ranks), atscale (sizing at scale).
"""
