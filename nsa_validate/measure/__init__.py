"""How a figure is obtained and when it can be trusted: the one timing helper (``timing``), the
one tolerance helper (``tolerance``), the hardware ceilings no figure may pass (``limits``), the
roofline labels (``roofline``), proof that a path executed (``evidence``) and Nsight Compute's
byte counts (``ncu``); where a case's time goes (``phases``)."""
