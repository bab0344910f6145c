"""Offline generator of simple children's stories, a stand-in for TinyStories on a machine with no hub.

A story is planned first (a cast of three with pronouns, a place, a treasured object, a plot) and then
rendered by a small grammar: every sentence is drawn from many clause shapes joined by connectives and
subordinate clauses, so a small model cannot simply memorise a handful of templates.

    plan = plan_story(rng)               # who, where, what, which plot
    text = render_story(plan, rng)       # paragraphs of past-tense narration and dialogue

The only words that refer to people or animals in the narration are their names, descriptions and the
pronouns of the planned cast (plus "they" for the hero and friend together), so a story whose cast is all
"she" never says "he" - tests rely on that. Standard library only; about 3 MB/s on one core.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .lexicon import (  # the generator's vocabulary
    BOYS,
    ELDERS,
    FEELINGS_BAD,
    FEELINGS_GOOD,
    GIRLS,
    HE,
    HOBBIES,
    INTENSE,
    IT,
    KINDS,
    MORNINGS,
    OBJECT_ADJS,
    OBJECTS,
    PET_NAMES,
    PLACES,
    SEASONS,
    SHE,
    SPEECH,
    TRAITS,
    WEATHER,
    Pronoun,
    a_an,
    cap,
)

# Between two stories in every corpus file: one story per block, no end-of-text token.
STORY_SEPARATOR = "\n\n\n"


@dataclass(slots=True)
class Character:
    name: str
    kind: str | None  # key of KINDS; None for an elder
    pron: Pronoun
    trait: str


@dataclass(slots=True)
class StoryPlan:
    """Everything fixed before rendering; the cast is the only source of pronouns in the text."""

    hero: Character
    friend: Character
    elder: Character  # a parent, grandparent or teacher who helps
    place: tuple  # an entry of PLACES
    obj: str  # "red kite"
    obj_plural: bool
    plot: str  # key of PLOTS


def make_character(rng: random.Random, kind: str, avoid: str = "") -> Character:
    if kind == "girl" or kind == "boy":
        pron = SHE if kind == "girl" else HE
        names = GIRLS if kind == "girl" else BOYS
    else:
        pron = rng.choice((SHE, HE, HE, SHE, IT)) if kind != "robot" else rng.choice((IT, IT, HE, SHE))
        names = PET_NAMES
    name = rng.choice(names)
    while name == avoid:
        name = rng.choice(names)
    return Character(name, kind, pron, rng.choice(TRAITS))


def plan_story(rng: random.Random) -> StoryPlan:
    kinds = list(KINDS)
    hero_kind = rng.choice(("girl", "boy", "girl", "boy", rng.choice(kinds)))
    hero = make_character(rng, hero_kind)
    friend = make_character(rng, rng.choice(kinds), avoid=hero.name)
    ename, epron = rng.choice(ELDERS)
    elder = Character(ename, None, epron, rng.choice(TRAITS))
    noun, plural, cat = rng.choice(OBJECTS)
    return StoryPlan(hero, friend, elder, rng.choice(PLACES), f"{rng.choice(OBJECT_ADJS[cat])} {noun}",
                     plural, rng.choice(tuple(PLOTS)))


# ----------------------------------------------------------------------------- the sentence grammar


class Teller:
    """Renders one plan: tracks who was mentioned last so pronouns point to the right character."""

    def __init__(self, plan: StoryPlan, rng: random.Random):
        self.p, self.r = plan, rng
        self.H, self.F, self.E = plan.hero, plan.friend, plan.elder
        self.last: object = None  # the character (or "pair") a pronoun would refer to now
        self.place = plan.place[0]
        self.spots = list(plan.place[3]) + ["under the bed", "behind the door", "in the toy box", "under a chair"]
        rng.shuffle(self.spots)

    # -- choice helpers
    def pick(self, seq):
        return seq[int(self.r.random() * len(seq))]

    def one(self, options: tuple[Callable[[], str], ...]) -> str:
        """Renders one of several alternative sentences; only the chosen one consumes randomness."""
        return options[int(self.r.random() * len(options))]()

    def maybe(self, p: float) -> bool:
        return self.r.random() < p

    def some(self, options: list[Callable[[], str]], k: int) -> list[str]:
        """k distinct options, kept in their listed order (so a sequence of events stays ordered)."""
        idx = sorted(self.r.sample(range(len(options)), k))
        return [options[i]() for i in idx]

    # -- references to characters
    def who(self, c: Character) -> str:
        """Subject: a pronoun when c was the last one mentioned, otherwise a name or description."""
        if self.last is c and self.maybe(0.45):
            return c.pron.subj
        self.last = c
        if c.kind and self.maybe(0.15):
            return f"the {self.pick((c.trait, 'little', 'young'))} {c.kind}"
        return c.name

    def whom(self, c: Character) -> str:
        if self.last is c and self.maybe(0.6):
            return c.pron.obj
        self.last = c
        return c.name

    def his(self, c: Character) -> str:
        if self.last is c:
            return c.pron.poss
        self.last = c
        return c.name + "'s"

    def pair(self) -> str:
        if self.last == "pair" and self.maybe(0.7):
            return "they"
        self.last = "pair"
        return self.pick((f"{self.H.name} and {self.F.name}", "the two friends", f"{self.F.name} and {self.H.name}",
                          "the friends", f"{self.H.name} and {self.H.pron.poss} friend"))

    def be(self, subject: str) -> str:
        return "were" if subject == "they" or " and " in subject or subject.startswith("the friends") \
            or subject.startswith("the two") else "was"

    # -- things
    def obj(self, owner: Character | None = None) -> str:
        o = self.p.obj
        if owner is not None:
            return f"{self.his(owner)} {o if self.maybe(0.5) else o.split(' ', 1)[1]}"
        return "the " + (o if self.maybe(0.6) else o.split(" ", 1)[1])

    def it(self) -> str:
        return "them" if self.p.obj_plural else "it"

    def it_was(self) -> str:
        return "they were" if self.p.obj_plural else "it was"

    def feel(self, good: bool) -> str:
        adv = self.pick(INTENSE)
        word = self.pick(FEELINGS_GOOD if good else FEELINGS_BAD)
        return f"{adv} {word}" if adv else word

    def when(self) -> str:
        return self.pick((f"One {self.pick(WEATHER)} {self.pick(MORNINGS)}", f"Early one {self.pick(SEASONS)} morning",
                          f"On a {self.pick(WEATHER)} {self.pick(SEASONS)} day", "One day", f"Late one {self.pick(WEATHER)} afternoon",
                          f"One {self.pick(SEASONS)} {self.pick(MORNINGS)}", "Yesterday", f"On a {self.pick(WEATHER)} {self.pick(MORNINGS)}"))

    def soon(self) -> str:
        return self.pick(("Then", "Soon", "After a while", "Just then", "Before long", "A moment later", "Suddenly",
                          "Next", "After that", "All at once", "Later"))

    # -- sentence shapes
    def sent(self, clause: str, end: str = ".") -> str:
        return cap(clause) + end

    def joined(self, first: str, second: str) -> str:
        """Two clauses about the same moment, joined by one of several connectives."""
        form = self.r.random()
        if form < 0.3:
            return cap(f"{first}, and {second}.")
        if form < 0.5:
            return cap(f"{first}, so {second}.")
        if form < 0.65:
            return f"{self.soon()}, {first}, and {second}."
        return cap(first) + ". " + cap(second) + "."

    def because(self, main: str, reason: str) -> str:
        form = self.r.random()
        if form < 0.45:
            return cap(f"{main} because {reason}.")
        if form < 0.7:
            return f"Because {reason}, {main}."
        return cap(f"{main}, since {reason}.")

    def say(self, c: Character, line: str, end: str = ".", to: Character | None = None) -> str:
        verb = self.pick(SPEECH[end])
        form = self.r.random()
        if form < 0.45:
            ref = self.who(c)
            mark = "," if end == "." else end
            return f'"{line}{mark}" {ref} {verb}.' if ref == c.pron.subj or form < 0.25 else f'"{line}{mark}" {verb} {ref}.'
        if form < 0.75 or to is None:
            return f'{cap(self.who(c))} {verb}, "{line}{end}"'
        who = cap(self.who(c))
        return f'{who} {self.pick(("looked at", "turned to", "smiled at", "ran up to"))} {self.whom(to)} and {verb}, "{line}{end}"'

    def color(self) -> str:
        """A descriptive sentence about the place, weather or a character's looks."""
        form = self.r.random()
        things = self.p.place[2]
        if form < 0.3:
            return self.sent(f"the {self.place} was full of {self.pick(things)} and {self.pick(things)}")
        if form < 0.55:
            sky = self.pick(("the sun was shining", "the sky was bright blue", "a soft wind was blowing",
                             "little clouds drifted by", "the air smelled of flowers", "the leaves were rustling"))
            return self.sent(f"{sky}, and {self.pick(things)} {self.pick(('could be seen everywhere', 'could be seen all around', 'made the ' + self.place + ' look lovely'))}")
        c = self.pick((self.H, self.F))
        if c.kind is None:
            return self.sent(f"{self.who(c)} had a warm smile")
        return self.sent(f"{self.who(c)} had {self.pick(KINDS[c.kind].looks)} and {self.pick(('loved', 'liked', 'enjoyed'))} {self.pick(HOBBIES)}")

    def go(self, c: Character, where: str) -> str:
        moves = KINDS[c.kind].moves if c.kind else ("walked", "hurried", "came")
        return f"{self.who(c)} {self.pick(moves)} {where}"

    # -- story frame
    def opening(self) -> list[str]:
        h, prep = self.H, self.p.place[1]
        kind = h.kind
        desc = f"{h.trait} {kind}" if self.maybe(0.6) else f"{h.trait} little {kind}"
        form = self.r.random()
        self.last = h
        if form < 0.25:
            first = f"Once upon a time, there was {a_an(desc)} named {h.name}."
        elif form < 0.45:
            first = f"{h.name} was {a_an(desc)} who lived near a {self.pick(('big', 'quiet', 'green', 'sunny', 'busy', 'little'))} {self.place}."
        elif form < 0.6:
            first = f"There once was {a_an(desc)} called {h.name} who loved {self.pick(HOBBIES)}."
        elif form < 0.8:
            first = f"{self.when()}, {a_an(desc)} named {h.name} went to play {prep} the {self.place}."
        else:
            first = f"{h.name} the {kind} loved {self.pick(HOBBIES)} more than anything."
        out = [first]
        if self.maybe(0.6):
            out.append(self.sent(f"{self.who(h)} had {self.pick(KINDS[kind].looks)} and {self.pick(('a big heart', 'lots of ideas', 'many friends', 'a loud laugh', 'a quiet voice'))}"))
        if self.maybe(0.5):
            out.append(self.color())
        f = self.F
        fdesc = f"{f.trait} {f.kind}"
        out.append(self.pick((
            lambda: f"{cap(self.his(h))} best friend was {a_an(fdesc)} named {f.name}.",
            lambda: f"{h.name} often played with {f.name}, {a_an(fdesc)} who {self.pick(('lived next door', 'lived nearby', 'was always full of ideas', 'liked ' + self.pick(HOBBIES)))}.",
            lambda: f"Every day, {h.name} and {f.name} the {f.kind} met {prep} the {self.place}.",
            lambda: f"{h.name} had a friend, {a_an(fdesc)} called {f.name}.",
        ))())
        self.last = f
        return out

    def ending(self, lessons: tuple[str, ...]) -> list[str]:
        h = self.H
        lesson = self.pick(lessons)
        out = [self.pick((
            lambda: f"{cap(self.who(h))} learned that {lesson}.",
            lambda: f"That day, {h.name} learned that {lesson}.",
            lambda: f'"{cap(lesson)}," {self.E.name} said, and {h.name} nodded.',
            lambda: f"From then on, {h.name} always remembered that {lesson}.",
            lambda: f"{cap(self.pair())} knew that {lesson}.",
        ))()]
        out.append(self.pick((
            lambda: f"That night, {h.name} fell asleep with a {self.pick(('big', 'happy', 'sleepy', 'warm'))} smile.",
            lambda: f"{h.name} and {self.F.name} played {self.p.place[1]} the {self.place} until the sun went down.",
            lambda: f"It was the best {self.pick(('day', 'afternoon', 'week', 'adventure'))} {h.name} had ever had.",
            lambda: f"And {h.name} was {self.feel(True)} for a long, long time.",
            lambda: f"The next day, {h.name} told {self.E.name} all about it.",
            lambda: f"{self.E.name} gave {h.name} a big hug, and everyone felt {self.pick(FEELINGS_GOOD)}.",
        ))())
        return out


# ----------------------------------------------------------------------------- plots


def plot_lost(t: Teller) -> list[list[str]]:
    h, f = t.H, t.F
    o = t.p.obj
    have = "were" if t.p.obj_plural else "was"
    problem = [
        t.sent(f"{t.when()}, {t.who(h)} wanted to play with {t.obj(h)}"),
        t.pick((
            lambda: t.joined(f"{t.who(h)} looked in {h.pron.poss} {t.pick(('room', 'bag', 'basket', 'box'))}", f"the {o} {have} not there"),
            lambda: f"But when {t.who(h)} looked for {t.it()}, the {o} {have} gone!",
            lambda: t.because(f"{t.who(h)} felt {t.feel(False)}", f"the {o} {have} nowhere to be found"),
        ))(),
        t.say(h, t.pick((f"Where is my {o}", f"Has anyone seen my {o}", f"What happened to my {o}")), "?"),
    ]
    tries = []
    for spot in t.spots[:3]:
        tries.append(t.pick((
            lambda spot=spot: t.joined(f"{t.who(h)} looked {spot}", f"the {o} {have} not there"),
            lambda spot=spot: f"{t.soon()}, {t.who(h)} searched {spot}, but found only {t.pick(('a sock', 'some dust', 'an old leaf', 'a button', 'a sleepy bug', 'a pebble'))}.",
            lambda spot=spot: t.sent(f"{t.go(h, 'to look ' + spot)}, but {t.it_was()} not there either"),
        ))())
    tries.insert(1, t.pick((
        lambda: t.say(f, t.pick(("I will help you look", "Don't worry, we will find it", "Let's look together")), t.pick(".!"), to=h),
        lambda: t.sent(f"{t.who(f)} saw that {h.name} was {t.feel(False)} and came to help"),
    ))())
    found = t.pick(("sleeping on it", "sitting on top of it", "playing with it", "hiding right next to it"))
    critter = t.pick(("a little kitten", "a sleepy puppy", "a baby squirrel", "a tiny mouse", "a fat frog"))
    resolution = [
        t.pick((
            lambda: f"{t.soon()}, {t.who(f)} {t.pick(('pointed', 'shouted', 'called'))} and found the {o} {t.pick(t.spots[3:])}.",
            lambda: f"At last, they found the {o} {t.spots[3]}, and {critter} was {found}!",
            lambda: f"Then {h.name} put {h.pron.poss} hand in {h.pron.poss} pocket, and there {have} the {o} all along!",
        ))(),
        t.say(h, t.pick((f"Thank you, {f.name}", "We found it", f"My {o}, you are back", "I am so happy")), "!"),
        t.sent(f"{t.who(h)} hugged {t.whom(f)} and felt {t.feel(True)}"),
    ]
    return [problem, tries, resolution]


def plot_storm(t: Teller) -> list[list[str]]:
    h, f = t.H, t.F
    where = f"{t.p.place[1]} the {t.place}"
    setup = [t.sent(f"{t.when()}, {t.pair()} were playing {where}"), t.color()]
    problem = [
        t.one((lambda: f"{t.soon()}, big dark clouds rolled across the sky.",
                lambda: f"Then the wind began to howl, and {t.who(f)} looked up at the gray sky.",
                lambda: f"All at once, thunder boomed over the {t.place}.")),
        t.one((lambda: t.sent(f"rain began to fall on the {t.place}, first slowly and then very hard"),
                lambda: f"Cold raindrops splashed on the {t.pick(t.p.place[2])}, and {h.name} shivered.",
                lambda: t.sent(f"a flash of lightning lit up the {t.place}"))),
        t.because(f"{t.who(h)} felt {t.feel(False)}", f"{h.pron.subj} did not like storms"),
        t.say(f, t.pick(("Quick, let's find a dry place", "Don't be scared, I know where to go", "Follow me")), "!", to=h),
    ]
    shelter = t.pick(("an old barn", "a little hut", "a dry cave", "a wooden shed", "a big porch"))
    tries = [
        t.sent(f"{t.pair()} {t.pick(('ran', 'hurried', 'raced'))} through the puddles to {shelter}"),
        t.one((lambda: t.sent(f"inside {shelter}, it was dark, but it was dry and safe"),
                lambda: t.joined(f"{t.who(f)} held {h.name}'s hand", f"{h.name} felt a little braver"),
                lambda: t.sent(f"{t.who(h)} shook the water off and listened to the rain drum on the roof"))),
        t.say(h, t.pick(("I was scared, but I am okay now", "Thank you for staying with me", "It is loud, but we are safe")), "."),
    ]
    resolution = [
        t.sent(f"{t.pick(('after a while', 'at last', 'soon', 'before long'))}, the rain stopped and the sun shone on {t.pair()}"),
        t.one((lambda: t.sent(f"a bright rainbow stretched across the sky over the {t.place}"),
                lambda: t.sent(f"the whole {t.place} sparkled with raindrops"),
                lambda: t.sent(f"{t.E.name} came to find them with a warm blanket"))),
        t.sent(f"{t.who(h)} smiled, and {h.pron.subj} was not {t.pick(FEELINGS_BAD)} anymore"),
    ]
    return [setup, problem, tries, resolution]


def plot_friend(t: Teller) -> list[list[str]]:
    h, f = t.H, t.F
    where = f"{t.p.place[1]} the {t.place}"
    setup = [
        t.one((lambda: t.because(f"{t.who(h)} felt {t.feel(False)}", "nobody wanted to play"),
                lambda: t.sent(f"{t.when()}, {t.who(h)} sat alone {where}"),
                lambda: t.sent(f"{t.who(h)} had just moved to a new home near the {t.place}"))),
        t.sent(f"{t.who(h)} saw {a_an(f.kind)} {t.pick(('sitting under a tree', 'standing by itself' if f.pron is IT else 'standing by ' + f.pron.refl, 'playing alone', 'looking at the clouds'))}"),
    ]
    problem = [
        t.because(f"{t.who(h)} did not know what to say", f"{h.pron.subj} was {t.pick(('shy', 'nervous', 'a little scared'))}"),
        t.sent(f"{t.who(h)} took a deep breath and {t.pick(('walked', 'stepped', 'went', 'moved'))} over to the {f.kind}"),
        t.say(h, t.pick(("Hello, my name is " + h.name, "Hi! Do you want to play with me", "Hello! What is your name")),
              t.pick(("!", "."))),
        t.say(f, t.pick((f"I am {f.name}", f"My name is {f.name}", f"Hi, I am {f.name}, and I would love to play")), "!", to=h),
    ]
    game = t.pick(HOBBIES)
    tries = [
        t.sent(f"{t.pair()} spent the whole {t.pick(MORNINGS)} {game}"),
        t.one((lambda: t.joined(f"{t.who(f)} showed {h.name} {f.pron.poss} {t.p.obj}", f"{h.name} shared {h.pron.poss} snack"),
                lambda: t.sent(f"{t.who(f)} told funny jokes, and {h.name} laughed and laughed"))),
        t.color(),
    ]
    resolution = [
        t.say(h, t.pick(("Will you come back tomorrow", "Can we play again", "Will you be my friend")), "?", to=f),
        t.say(f, t.pick(("Yes, of course", "I would like that very much", "Every day")), t.pick(".!")),
        t.sent(f"from that day on, {h.name} and {f.name} were best friends"),
    ]
    return [setup, problem, tries, resolution]


def plot_race(t: Teller) -> list[list[str]]:
    h, f = t.H, t.F
    goal = t.pick(("the big oak tree", "the old gate", "the top of the hill", "the red fence", "the pond", "the blue house"))
    setup = [
        t.say(f, f"Let's race to {goal}", "!", to=h),
        t.sent(f"{t.who(h)} {t.pick(('grinned', 'nodded', 'jumped up'))} and said {h.pron.subj} would win"),
        cap(f"{t.pick(('ready', 'one, two, three', 'on your marks'))}, go! ") + t.sent(f"{t.pair()} took off across the {t.place}"),
    ]
    problem = [
        t.sent(f"{t.who(h)} was {t.pick(('fast', 'quick', 'ahead'))}, but then {t.who(h)} {t.pick(('tripped over a root', 'slipped in the mud', 'stubbed a toe on a rock', 'fell into a bush'))}"),
        t.say(h, t.pick(("Ouch", "Oh no", "My knee hurts")), "!"),
        t.sent(f"{t.who(f)} could have run on and won, but {f.pron.subj} stopped"),
    ]
    tries = [
        t.say(f, t.pick(("Are you okay", "Can you stand up", "Do you need help")), "?", to=h),
        t.sent(f"{t.who(f)} helped {h.name} up and brushed off the {t.pick(('dirt', 'leaves', 'mud', 'grass'))}"),
    ]
    resolution = [
        t.sent(f"then {t.pair()} walked to {goal} together, side by side"),
        t.say(h, t.pick((f"You are a true friend, {f.name}", "Nobody won, but I am happy", "Thank you for waiting for me")), t.pick(".!")),
        t.sent(f"{t.who(h)} felt {t.feel(True)} because a friend mattered more than a race"),
    ]
    return [setup, problem, tries, resolution]


def plot_bake(t: Teller) -> list[list[str]]:
    h, e = t.H, t.E
    treat = t.pick(("cookies", "a cake", "muffins", "an apple pie", "bread", "pancakes", "a berry tart", "cupcakes"))
    why = t.pick((f"{t.F.name}'s birthday", "a picnic", "the new neighbors", "a rainy day treat", "the school fair"))
    setup = [
        t.sent(f"{t.when()}, {t.who(h)} and {e.name} decided to bake {treat} for {why}"),
        t.sent(f"they got out flour, eggs, butter and {t.pick(('sugar', 'honey', 'berries', 'chocolate chips', 'cinnamon'))}"),
        t.say(e, t.pick(("First we mix, then we bake", "Read the recipe carefully", "Let's wash our hands first")), ".", to=h),
    ]
    oops = t.pick(("put in salt instead of sugar", "forgot to add the eggs", "dropped the bowl on the floor",
                   "left the oven on too long", "spilled flour everywhere"))
    problem = [
        t.sent(f"but {t.who(h)} was in a hurry and {oops}"),
        t.one((lambda: t.sent(f"when {t.pick(('the treats came out', 'they looked', 'they tasted it'))}, it was a mess"),
                lambda: f"The kitchen smelled funny, and {e.name} {t.pick(('laughed', 'sighed', 'smiled', 'shook ' + e.pron.poss + ' head'))}.")),
        t.say(h, t.pick(("Oh no, I ruined it", "I made a mistake", "It is all wrong")), "!"),
    ]
    tries = [
        t.say(e, t.pick(("Everyone makes mistakes", "We can try again", "Don't worry, let's start over")), ".", to=h),
        t.sent(f"this time, {t.who(h)} went slowly and {t.pick(('read every step', 'measured everything', 'listened carefully'))}"),
        t.sent(f"soon {e.name}'s kitchen smelled {t.pick(('sweet', 'warm', 'wonderful', 'delicious'))}"),
    ]
    resolution = [
        t.sent(f"{treat} came out {t.pick(('golden', 'perfect', 'soft and warm', 'just right'))}".replace("a ", "the ", 1) if treat.startswith(("a ", "an ")) else f"The {treat} came out {t.pick(('golden', 'perfect', 'soft and warm', 'just right'))}."),
        t.sent(f"{t.who(h)} shared them with {t.F.name}, and everyone asked for more"),
    ]
    return [setup, problem, tries, resolution]


def plot_fear(t: Teller) -> list[list[str]]:
    h, f, e = t.H, t.F, t.E
    fear, brave = t.pick((("the dark", "turned off the light"), ("the deep water", "jumped into the pond"),
                          ("the big slide", "went down the slide"), ("thunder", "listened to the storm"),
                          ("the tall ladder", "climbed the ladder"), ("the noisy bees", "walked past the hive"),
                          ("the old bridge", "walked across the bridge")))
    setup = [
        t.sent(f"{t.who(h)} was afraid of {fear}"),
        t.one((lambda: t.sent(f"every time {h.name} thought about {fear}, {h.pron.poss} tummy felt funny"),
                lambda: t.because(f"{t.who(h)} stayed away from {fear}", f"{h.pron.subj} felt {t.feel(False)}"))),
    ]
    problem = [
        t.sent(f"{t.when()}, {t.who(f)} wanted to go near {fear} together"),
        t.say(h, t.pick(("I can't do it", "I am too scared", "What if something bad happens")), t.pick(("!", "."))),
    ]
    tries = [
        t.say(e, t.pick(("Being brave means trying even when you are scared", "Take one small step at a time",
                         "I will be right here with you")), ".", to=h),
        t.sent(f"{t.who(h)} took one small step, then another"),
        t.one((lambda: t.sent(f"{t.who(f)} held {h.name}'s hand the whole time"),
                lambda: t.sent(f"{t.who(h)} counted to three and breathed slowly"))),
    ]
    resolution = [
        t.sent(f"at last, {h.name} {brave}, and it was not so bad after all"),
        t.say(h, t.pick(("I did it", "That was fun", "I am not scared anymore")), "!"),
        t.sent(f"{t.who(e)} was proud, and {h.name} felt {t.feel(True)}"),
    ]
    return [setup, problem, tries, resolution]


def plot_share(t: Teller) -> list[list[str]]:
    h, f = t.H, t.F
    o = t.p.obj
    setup = [
        t.sent(f"{t.when()}, {t.who(h)} got a new {o}"),
        t.sent(f"{t.who(h)} played with {t.it()} all day and did not want to put {t.it()} down"),
    ]
    problem = [
        t.say(f, t.pick((f"Can I play with your {o} too", "May I have a turn", "Can we play together")), "?", to=h),
        t.say(h, t.pick(("No, it is mine", "Not now", "I want it all to myself")), t.pick(("!", "."))),
        t.sent(f"{t.who(f)} looked down and {t.pick(('walked away slowly', 'sat alone on a bench', 'did not say anything'))}"),
    ]
    tries = [
        t.sent(f"soon, {h.name} did not feel happy anymore, even with {h.pron.poss} {o}"),
        t.because(f"playing alone {t.p.place[1]} the {t.place} was not much fun", f"there was nobody to {t.pick(('laugh', 'talk', 'play', 'share jokes'))} with"),
        t.say(t.E, "How would you feel if you were " + f.name, "?", to=h),
    ]
    resolution = [
        t.sent(f"{t.who(h)} ran to {f.name} and held out the {o}"),
        t.say(h, t.pick(("I am sorry, let's share", "You can have a turn", "We can play together")), "."),
        t.sent(f"{t.pair()} took turns, and it was much more fun than playing alone"),
    ]
    return [setup, problem, tries, resolution]


def plot_mistake(t: Teller) -> list[list[str]]:
    h, f, e = t.H, t.F, t.E
    thing = t.pick((f"{f.name}'s {t.p.obj}", f"{e.name}'s favorite cup", f"the {t.pick(('blue', 'old', 'pretty'))} vase",
                    f"{f.name}'s sandcastle", f"{e.name}'s flower pot"))
    setup = [t.sent(f"{t.when()}, {t.who(h)} was {t.pick(('running', 'dancing', 'spinning', 'playing ball'))} in the house"), t.color()]
    problem = [
        t.sent(f"by accident, {h.name} knocked over {thing}, and it broke"),
        t.sent(f"{t.who(h)} felt {t.feel(False)} and hid behind the {t.pick(('sofa', 'curtain', 'door', 'tree'))}"),
        t.one((lambda: t.sent(f"{t.who(h)} thought about not telling anyone"),
                lambda: t.say(h, "What should I do", "?"))),
    ]
    tries = [
        t.sent(f"then {t.who(h)} remembered what {e.name} always said about telling the truth"),
        t.say(h, t.pick((f"I am sorry, I broke {thing}", "It was my fault, and I am sorry", "I made a mistake. I am very sorry")), "."),
    ]
    resolution = [
        t.say(e, t.pick(("Thank you for telling the truth", "Accidents happen", "I forgive you")), ".", to=h),
        t.sent(f"together, {h.name} and {e.name} {t.pick(('glued the pieces back', 'cleaned up the mess', 'made a new one', 'fixed it with tape'))}"),
        t.sent(f"{t.who(h)} felt {t.feel(True)}, because saying sorry had made things right"),
    ]
    return [setup, problem, tries, resolution]


def plot_animal(t: Teller) -> list[list[str]]:
    h, e = t.H, t.E
    animal, trouble, cure = t.pick((("bird", "had a hurt wing", "flapped its wings and flew"),
                                    ("kitten", "was stuck up in a tree", "purred and licked its paws"),
                                    ("duckling", "had lost its mother", "waddled back to its family"),
                                    ("puppy", "was shivering in the rain", "wagged its tail"),
                                    ("hedgehog", "was tangled in some string", "trotted off into the bushes")))
    setup = [t.sent(f"{t.when()}, {t.go(h, 'to the ' + t.place)}"), t.color()]
    problem = [
        t.sent(f"there, {t.who(h)} found a little {animal} that {trouble}"),
        t.say(h, t.pick(("Poor little thing", "Oh no, you need help", "Don't worry, I will help you")), "!"),
    ]
    tries = [
        t.sent(f"{t.who(h)} gently {t.pick(('picked it up', 'wrapped it in a scarf', 'carried it home', 'stayed close to it'))}"),
        t.sent(f"{e.name} showed {h.name} how to {t.pick(('give it water', 'keep it warm', 'make a soft bed', 'be very gentle'))}"),
        t.sent(f"every day, {h.name} checked on the {animal}, and it got a little stronger"),
    ]
    resolution = [
        t.sent(f"at last, {h.name}'s {animal} {cure}"),
        t.say(h, t.pick(("Goodbye, little friend", "You are all better", "Come back and visit")), "!"),
        t.sent(f"{t.who(h)} waved and felt {t.feel(True)}"),
    ]
    return [setup, problem, tries, resolution]


def plot_build(t: Teller) -> list[list[str]]:
    h, f = t.H, t.F
    thing, ruin = t.pick((("a sandcastle", "a big wave washed it away"), ("a snowman", "the sun melted its head"),
                          ("a tower of blocks", "it wobbled and fell down"), ("a blanket fort", "the blankets slid off"),
                          ("a tree house", "a board fell off"), ("a toy boat", "it sank in the pond")))
    setup = [t.sent(f"{t.when()}, {t.who(h)} wanted to build {thing}"), t.color()]
    problem = [
        t.sent(f"{t.who(h)} worked hard all {t.pick(MORNINGS)}, but {ruin}"),
        t.say(h, t.pick(("It is ruined", "I give up", "All my work is gone")), "!"),
    ]
    tries = [
        t.say(f, t.pick(("Let's build it again, together", "I can help you", "Two can do more than one")), "!", to=h),
        t.sent(f"this time, {t.pair()} made it {t.pick(('stronger', 'bigger', 'better', 'wider'))} and worked as a team"),
        t.sent(f"{t.who(f)} {t.pick(('carried', 'found', 'brought'))} {t.pick(('sticks', 'stones', 'shells', 'string', 'pieces'))}, and {h.name} put them in place"),
    ]
    resolution = [
        t.sent(f"when they finished, it was the best {thing.split(' ', 1)[1]} in the whole {t.place}"),
        t.say(h, t.pick(("We did it", "It is perfect", "Look what we made")), "!"),
    ]
    return [setup, problem, tries, resolution]


def plot_learn(t: Teller) -> list[list[str]]:
    h, e = t.H, t.E
    skill = t.pick(("ride a bike", "swim", "whistle", "tie shoes", "skip a stone", "jump rope", "read a whole book",
                    "fly a kite", "climb the rope"))
    setup = [t.sent(f"{t.who(h)} really wanted to learn to {skill}"), t.color()]
    problem = [
        t.sent(f"{t.who(h)} tried to {skill} once, but it did not work"),
        t.sent(f"{t.who(h)} tried again and {t.pick(('fell down', 'got it wrong', 'made a silly mistake', 'almost cried'))}"),
        t.say(h, t.pick((f"I will never learn to {skill}", "This is too hard", "Why can't I do it")), t.pick(("!", "?"))),
    ]
    tries = [
        t.say(e, t.pick(("Keep trying, a little every day", "Nobody is good at something at first", "You are getting better")), ".", to=h),
        t.sent(f"so {h.name} practiced in the {t.pick(MORNINGS)} and practiced {t.pick(('after lunch', 'before bed', 'on rainy days'))}"),
    ]
    resolution = [
        t.sent(f"then, one {t.pick(WEATHER)} {t.pick(MORNINGS)}, {h.name} could {skill} all by {h.pron.refl}"),
        t.say(h, t.pick((f"Look, {e.name}! I can do it", f"I did it, {e.name}", "Practice really works")), "!"),
    ]
    return [setup, problem, tries, resolution]


def plot_trip(t: Teller) -> list[list[str]]:
    h, f, e = t.H, t.F, t.E
    dest, seen = t.pick((("the sea", "boats and waves"), ("the mountains", "snowy peaks"), ("the big city", "tall buildings"),
                         ("a farm", "cows and sheep"), ("the zoo", "elephants and lions"), ("a lake", "ducks and fish")))
    ride = t.pick(("car", "train", "bus", "boat"))
    setup = [
        t.sent(f"{t.when()}, {e.name} took {h.name} and {f.name} on a trip to {dest} by {ride}"),
        t.sent(f"on the way, {t.pair()} saw {seen} and sang songs"),
    ]
    problem = [
        t.sent(f"at {dest}, {t.who(h)} stopped to look at {t.pick(('a butterfly', 'a shiny shell', 'a funny sign', 'a big balloon'))}"),
        t.sent(f"when {h.pron.subj} looked up, {e.name} was gone"),
        t.say(h, t.pick((f"{e.name}, where are you", "Where did everyone go")), "?"),
    ]
    tries = [
        t.sent(f"{t.who(h)} remembered what {e.name} had said: stay in one place and call for help"),
        t.sent(f"{t.who(h)} stood still and called for {f.name} and {e.name}"),
    ]
    resolution = [
        t.sent(f"soon {f.name} came running, and {e.name} was right behind"),
        t.say(e, t.pick(("You did the right thing", "I am so glad we found you", "Good job staying put")), ".", to=h),
        t.sent(f"the rest of the trip to {dest} was {t.pick(('fun', 'wonderful', 'full of surprises', 'perfect'))}"),
    ]
    return [setup, problem, tries, resolution]


PLOTS: dict[str, tuple[Callable[[Teller], list[list[str]]], tuple[str, ...]]] = {
    "lost": (plot_lost, ("it helps to have a friend", "you should never give up", "it is good to put things away")),
    "storm": (plot_storm, ("storms do not last forever", "friends keep each other safe", "it is okay to be scared")),
    "friend": (plot_friend, ("saying hello can make a new friend", "being brave can bring good things", "new friends are a gift")),
    "race": (plot_race, ("friends matter more than winning", "helping others is the real win", "kindness is better than winning")),
    "bake": (plot_bake, ("mistakes help us learn", "going slowly can be better", "sharing makes treats taste better")),
    "fear": (plot_fear, ("being brave means trying anyway", "small steps can lead to big things", "fears can get smaller")),
    "share": (plot_share, ("sharing makes everyone happy", "toys are more fun with friends", "being kind feels good")),
    "mistake": (plot_mistake, ("telling the truth is important", "saying sorry can fix a lot", "everyone makes mistakes")),
    "animal": (plot_animal, ("even small helpers can do big things", "being gentle is important", "we should care for animals")),
    "build": (plot_build, ("teamwork makes things better", "you can always try again", "it is fine to start over")),
    "learn": (plot_learn, ("practice helps you grow", "you should keep trying", "hard things get easier")),
    "trip": (plot_trip, ("it is important to stay calm", "listening to grown-ups keeps you safe", "adventures are fun with family")),
}


def render_story(plan: StoryPlan, rng: random.Random) -> str:
    t = Teller(plan, rng)
    fn, lessons = PLOTS[plan.plot]
    paragraphs = [t.opening()] + fn(t) + [t.ending(lessons)]
    return "\n\n".join(" ".join(p) for p in paragraphs)


# ----------------------------------------------------------------------------- public API


def generate_story(rng: random.Random) -> str:
    return render_story(plan_story(rng), rng)


def generate_stories(n: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(n):
        yield generate_story(rng)


def write_corpus(out_dir, *, num_stories: int, seed: int = 0, shard_stories: int = 50_000,
                 eval_fraction: float = 0.01) -> dict:
    """Writes train-NNNNN.txt shards and eval.txt; eval comes from its own seed stream (disjoint)."""
    os.makedirs(out_dir, exist_ok=True)
    num_eval = max(1, int(num_stories * eval_fraction)) if eval_fraction > 0 else 0
    num_train = num_stories - num_eval
    train_paths, total = [], 0
    stories = generate_stories(num_train, seed * 2)
    for shard in range(max(1, -(-num_train // shard_stories))):
        chunk = [next(stories) for _ in range(min(shard_stories, num_train - shard * shard_stories))]
        path = os.path.join(out_dir, f"train-{shard:05d}.txt")
        total += _write(path, chunk)
        train_paths.append(path)
    eval_path = os.path.join(out_dir, "eval.txt")
    evals = list(generate_stories(num_eval, seed * 2 + 1))
    total += _write(eval_path, evals)
    return {"train": train_paths, "eval": eval_path, "num_stories": num_train + len(evals), "bytes": total}


def _write(path: str, stories: list[str]) -> int:
    data = STORY_SEPARATOR.join(stories) + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(data)
    return len(data.encode("utf-8"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--stories", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-stories", type=int, default=50_000)
    ap.add_argument("--eval-fraction", type=float, default=0.01)
    args = ap.parse_args(argv)
    info = write_corpus(args.out_dir, num_stories=args.stories, seed=args.seed, shard_stories=args.shard_stories,
                        eval_fraction=args.eval_fraction)
    print(f"wrote {info['num_stories']} stories, {info['bytes'] / 1e6:.1f} MB: {len(info['train'])} train shards + {info['eval']}")


if __name__ == "__main__":
    main()
