"""The fixed English text the synth tokenizer is trained on (kept apart: it is data, not code)."""

# The synth tokenizer's training text: any English works; it must allow 765 merges, and must never change (the
# synth:tiny model's ids depend on it).
SYNTH_TEXT = """\
The river runs past the old mill, and in the spring the water rises over the stones. Children walk along the bank
to school each morning, counting the boats that carry wheat, wood and wool down to the harbour. When the weather
turns cold, the fishermen mend their nets by the fire and tell stories about storms they have seen at sea.

A mixture of experts is a neural network in which a small router chooses, for every token, a few experts out of
many. Each expert is a feed-forward block with its own weights. Only the chosen experts run, so the model can hold
far more parameters than it spends on any single token. The price is memory: all the experts must live somewhere,
and moving them between host memory and the graphics card takes time that careful scheduling tries to hide.

Good software is written twice: once to learn what the problem is, and once to solve it. Tests describe what the
program promises; comments explain why a choice was made; names tell the reader where to look next. A function
should do one thing, and its inputs and outputs should be plain data that anyone can print, compare and save.

In 1969 two astronauts walked on the Moon while a third waited in orbit. The computer that guided them had about
4 kilobytes of erasable memory and 72 kilobytes of rope memory, woven by hand. Today a phone holds a million times
more, yet the questions are the same: what must we remember, what can we forget, and what should we fetch again?

She opened the window, listened to the birds, and wrote a short letter to her brother: "The garden is green, the
apples are nearly ripe, and the cat has learned to open the kitchen door. Come in August if you can; we will bake
bread, climb the hill behind the church and watch the stars from the field where we played as children."

The market opens at dawn. Farmers unload baskets of onions, peppers, cherries and eggs; a baker shouts the price of
warm rolls; musicians tune a violin and a guitar near the fountain. By noon the square is crowded, the tables are
empty, and someone is always looking for a lost umbrella, a lost dog, or a friend who promised to be there early.

Light travels about three hundred thousand kilometres per second, yet sunlight needs more than eight minutes to
reach us. Physics asks how things move; chemistry asks what they are made of; biology asks how living cells grow,
divide, remember and repair themselves. Every careful measurement begins with a quiet question and a notebook.

Winter came early that year. Snow covered the roofs, the trains were late, and the library stayed open until
midnight so that people could sit somewhere warm. Quietly, a young engineer sketched a bridge of glass and steel.

Numbers, dates and prices appear everywhere: 3.14, 2024-05-17, $19.99, 100%, 7 x 8 = 56, (a + b) * c / 2.
Programmers write things like `x = f(y)`, if (n > 0) { return n - 1; } and print("hello, world") every day.
Questions? Answers! Lists: first, second, third; items - one, two, three... and the end.
"""
