"""`hebrus-mlx simulate`: project decode speed for a machine that is not this one from route traces
and measured or published costs (model: the timing model; profiles/: shipped machine profiles;
validate: the check against measured bench runs on this machine)."""
