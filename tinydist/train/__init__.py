"""Training: layers and modules (nn), optimizers (optim), checkpoints (serialization). Data
parallel training (`td.parallel`) lives in tinydist.dist: it runs over the devices of a process
(tinydist.multi) or over processes (tinydist.dist), so it sits above both."""
