"""Word pools and small grammar helpers of the offline story generator (training/corpus.py):
the cast's kinds and pronouns, names, places, objects, feelings, weather and speech verbs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pronoun:
    subj: str  # she / he / it
    obj: str  # her / him / it
    poss: str  # her / his / its
    refl: str  # herself / himself / itself


SHE = Pronoun("she", "her", "her", "herself")
HE = Pronoun("he", "him", "his", "himself")
IT = Pronoun("it", "it", "its", "itself")


@dataclass(frozen=True, slots=True)
class Kind:
    noun: str  # "girl", "dog"
    person: bool  # people talk about "my room"; animals about "my nest"
    looks: tuple[str, ...]  # "curly red hair": what "X had ..." completes with
    moves: tuple[str, ...]  # past-tense ways to go somewhere: "ran", "flew"
    sound: str  # past-tense noise made when happy: "barked"


KINDS = {
    "girl": Kind("girl", True, ("curly red hair", "a big smile", "a missing front tooth", "two long braids",
                                "bright green boots", "lots of freckles"), ("ran", "skipped", "hurried", "walked"), "laughed"),
    "boy": Kind("boy", True, ("messy brown hair", "a big smile", "a missing front tooth", "a blue cap",
                              "muddy sneakers", "lots of freckles"), ("ran", "hurried", "raced", "walked"), "laughed"),
    "dog": Kind("dog", False, ("floppy ears", "a waggy tail", "a spotty coat", "a wet black nose"),
                ("ran", "dashed", "trotted", "bounded"), "barked"),
    "cat": Kind("cat", False, ("soft gray fur", "long white whiskers", "a fluffy tail", "green eyes"),
                ("crept", "tiptoed", "padded", "dashed"), "purred"),
    "bird": Kind("bird", False, ("blue feathers", "a tiny orange beak", "bright yellow wings", "a red chest"),
                 ("flew", "fluttered", "hopped", "swooped"), "sang"),
    "bunny": Kind("bunny", False, ("long floppy ears", "a fluffy white tail", "soft brown fur", "a twitchy nose"),
                  ("hopped", "bounced", "ran", "scampered"), "squeaked"),
    "bear": Kind("bear", False, ("thick brown fur", "big round ears", "a honey-colored nose", "huge soft paws"),
                 ("lumbered", "walked", "ran", "trotted"), "growled happily"),
    "fox": Kind("fox", False, ("a bushy orange tail", "pointy ears", "a white-tipped tail", "clever eyes"),
                ("trotted", "dashed", "crept", "ran"), "yipped"),
    "dragon": Kind("dragon", False, ("shiny green scales", "small purple wings", "a long curly tail", "kind golden eyes"),
                   ("flew", "stomped", "swooped", "flapped"), "puffed a little smoke"),
    "robot": Kind("robot", False, ("blinking blue lights", "shiny silver arms", "a round metal head", "squeaky wheels"),
                  ("rolled", "zoomed", "clanked", "beeped along"), "beeped"),
    "mouse": Kind("mouse", False, ("tiny pink ears", "a long thin tail", "soft gray fur", "quick little feet"),
                  ("scurried", "scampered", "dashed", "crept"), "squeaked"),
    "duck": Kind("duck", False, ("a flat orange bill", "soft yellow feathers", "webbed feet", "shiny white feathers"),
                 ("waddled", "paddled", "flew", "hurried"), "quacked"),
    "turtle": Kind("turtle", False, ("a round green shell", "slow steady legs", "a wrinkly neck", "a spotted shell"),
                   ("crawled", "plodded", "walked", "swam"), "smiled slowly"),
}
GIRLS = ("Mia", "Lily", "Emma", "Sara", "Zoe", "Ava", "Ella", "Lucy", "Anna", "Rosie", "Maya", "Nora", "Chloe",
         "Ruby", "Grace", "Hannah", "Amy", "Ivy", "Kate", "Molly", "Sophie", "Tara", "Jenny", "Daisy", "Poppy",
         "Nina", "Layla", "Hazel", "Clara", "Bella", "Julia", "Iris", "Alice", "Olive", "Luna", "Fiona")
BOYS = ("Tom", "Ben", "Leo", "Max", "Sam", "Jack", "Finn", "Noah", "Liam", "Owen", "Eli", "Jake", "Tim", "Luke",
        "Alex", "Theo", "Oscar", "Ryan", "Danny", "Henry", "Milo", "Adam", "Charlie", "Toby", "Jonah", "Ethan",
        "Felix", "Hugo", "Oliver", "Peter", "Kai", "Lucas", "Omar", "Ravi", "Simon", "Caleb")
PET_NAMES = ("Spot", "Buddy", "Whiskers", "Pip", "Sunny", "Coco", "Biscuit", "Pebble", "Ziggy", "Max", "Button",
             "Muffin", "Sparky", "Tiny", "Patch", "Bubbles", "Ginger", "Rusty", "Noodle", "Peanut", "Flash",
             "Shadow", "Bolt", "Clover", "Honey", "Pepper", "Scout", "Maple", "Toffee", "Ollie")
ELDERS = (("Mom", SHE), ("Dad", HE), ("Grandma", SHE), ("Grandpa", HE), ("Aunt Rose", SHE), ("Uncle Ben", HE),
          ("Miss Lily", SHE), ("Farmer Joe", HE), ("Granny Sue", SHE), ("Old Owl", HE), ("Mama Bear", SHE),
          ("Papa Bear", HE), ("Teacher Ann", SHE), ("Mister Gray", HE), ("Nana", SHE), ("Captain Jo", SHE))
TRAITS = ("kind", "curious", "happy", "shy", "brave", "little", "playful", "gentle", "clever", "cheerful",
          "friendly", "busy", "silly", "quiet", "small", "lively", "careful", "sleepy")

# name, preposition, things seen there, a nearby spot to look in.
PLACES = (
    ("park", "in", ("tall trees", "green grass", "swings", "a small pond"), ("under the slide", "behind a bench", "near the swings")),
    ("forest", "in", ("tall pine trees", "soft moss", "singing birds", "mushrooms"), ("under a log", "behind a big rock", "inside a hollow tree")),
    ("beach", "at", ("warm sand", "blue waves", "seashells", "crabs"), ("behind a sand dune", "under a towel", "near the rocks")),
    ("garden", "in", ("bright flowers", "buzzing bees", "ripe tomatoes", "tall sunflowers"), ("under a bush", "behind the shed", "in the flower bed")),
    ("farm", "on", ("cows", "a big red barn", "fields of corn", "noisy chickens"), ("in the hay", "behind the barn", "near the pig pen")),
    ("village", "in", ("little houses", "a bakery", "a stone well", "cobbled streets"), ("by the well", "behind the bakery", "under a cart")),
    ("meadow", "in", ("wild flowers", "butterflies", "tall grass", "a little stream"), ("in the tall grass", "by the stream", "under a daisy bush")),
    ("playground", "at", ("slides", "a sandbox", "a merry-go-round", "monkey bars"), ("in the sandbox", "under the slide", "behind the monkey bars")),
    ("lake", "by", ("quiet water", "ducks", "a wooden dock", "lily pads"), ("under the dock", "among the reeds", "by a rowboat")),
    ("hill", "on", ("soft grass", "a lonely tree", "big white rocks", "wild berries"), ("behind the tree", "between the rocks", "in a rabbit hole")),
    ("town", "in", ("busy shops", "a fountain", "a clock tower", "a toy store"), ("by the fountain", "under a market stall", "near the toy store")),
    ("zoo", "at", ("giraffes", "a sleepy lion", "monkeys", "a big pond of penguins"), ("near the penguins", "under a bench", "by the gate")),
    ("river", "by", ("smooth stones", "little fish", "a wooden bridge", "willow trees"), ("under the bridge", "between the stones", "by a willow tree")),
    ("backyard", "in", ("a big oak tree", "a wooden fence", "a sandbox", "a vegetable patch"), ("under the porch", "behind the fence", "in the sandbox")),
)

# noun, plural?, what kind of adjective fits.
OBJECTS = (
    ("ball", False, "toy"), ("kite", False, "toy"), ("teddy bear", False, "soft"), ("hat", False, "wear"),
    ("toy boat", False, "toy"), ("book", False, "book"), ("seashell", False, "nature"), ("crayons", True, "toy"),
    ("balloon", False, "toy"), ("drum", False, "toy"), ("blanket", False, "soft"), ("key", False, "shiny"),
    ("map", False, "book"), ("necklace", False, "shiny"), ("umbrella", False, "wear"), ("marbles", True, "shiny"),
    ("toy car", False, "toy"), ("doll", False, "soft"), ("toy train", False, "toy"), ("scarf", False, "wear"),
    ("whistle", False, "shiny"), ("boots", True, "wear"), ("robot toy", False, "toy"), ("acorn", False, "nature"),
    ("bell", False, "shiny"), ("picture book", False, "book"), ("mittens", True, "wear"), ("glasses", True, "wear"),
    ("wooden spoon", False, "toy"), ("ribbon", False, "wear"), ("pinwheel", False, "toy"), ("music box", False, "shiny"),
)
OBJECT_ADJS = {
    "toy": ("red", "blue", "yellow", "shiny", "little", "new", "old", "green", "orange", "striped"),
    "soft": ("soft", "fluffy", "old", "brown", "pink", "cozy", "little", "purple", "warm"),
    "wear": ("red", "blue", "yellow", "striped", "woolly", "new", "green", "purple", "spotted", "warm"),
    "book": ("old", "big", "colorful", "little", "special", "new", "torn", "magic"),
    "nature": ("smooth", "pretty", "tiny", "shiny", "speckled", "perfect", "little", "pink"),
    "shiny": ("shiny", "golden", "silver", "tiny", "sparkly", "old", "special", "little"),
}
MORNINGS = ("morning", "afternoon", "evening", "day")
WEATHER = ("sunny", "rainy", "windy", "cold", "warm", "snowy", "cloudy", "bright", "quiet", "foggy", "lovely", "chilly")
SEASONS = ("spring", "summer", "fall", "winter")
FEELINGS_GOOD = ("happy", "proud", "glad", "excited", "calm", "warm inside", "thankful", "cheerful", "joyful")
FEELINGS_BAD = ("sad", "worried", "scared", "upset", "lonely", "nervous", "grumpy", "cross", "afraid")
INTENSE = ("very", "so", "a little", "really", "quite", "too", "")
HOBBIES = ("playing in the sand", "reading books", "drawing pictures", "singing songs", "climbing trees",
           "looking at the stars", "building towers with blocks", "chasing butterflies", "jumping in puddles",
           "helping in the garden", "splashing in the water", "collecting shiny stones", "dancing to music",
           "flying kites", "counting clouds", "playing hide and seek", "making mud pies", "listening to stories",
           "picking flowers", "running fast", "painting rocks", "watching the birds", "telling jokes")
SPEECH = {
    ".": ("said", "said", "replied", "whispered", "explained", "answered", "added", "told them", "said softly",
          "said with a smile", "said kindly", "said slowly", "murmured", "said quietly"),
    "!": ("shouted", "cried", "exclaimed", "called", "said", "yelled", "cheered", "laughed", "gasped", "squealed"),
    "?": ("asked", "asked", "wondered", "asked softly", "asked quietly", "asked with a frown", "wanted to know"),
}


def a_an(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" and not phrase.startswith(("uni", "use")) else "a ") + phrase


def cap(text: str) -> str:
    return text[0].upper() + text[1:] if text else text
