"""How each ZeRO stage stores and moves data: layouts and explicit collectives."""
