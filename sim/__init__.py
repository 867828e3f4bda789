"""A discrete-event simulation of a tokenfab cluster: simulated engines, tokenfab's real router and
autoscaler policy. See sim/README.md for what is modelled and what is measured."""
